"""`axplug serve`'s default --max-len: the longest sequence along the run's lineage."""

from types import SimpleNamespace

from axplug_serve.startup import trained_len


def _loaded(seq_len, lineage_lens, max_positions=None):
    decoder = SimpleNamespace(max_positions=max_positions)
    lineage = [("run", {"config": {"input": {"seq_len": n}}}) for n in lineage_lens]
    return SimpleNamespace(config=SimpleNamespace(input=SimpleNamespace(seq_len=seq_len),
                                                  model=SimpleNamespace(decoder=decoder)),
                           lineage=lineage)  # fmt: skip


def test_a_fine_tune_keeps_its_bases_longer_sequences():
    assert trained_len(_loaded(64, [64, 256])) == 256  # tuned at 64 from a 256-token run
    assert trained_len(_loaded(512, [512])) == 512


def test_a_learned_position_table_caps_it_and_nothing_known_is_none():
    assert trained_len(_loaded(64, [64, 1024], max_positions=128)) == 128
    assert trained_len(_loaded(None, [])) is None
