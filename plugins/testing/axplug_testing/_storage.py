"""`StorageConformance`: a checkpoint storage backend's file semantics and a real checkpoint."""

from __future__ import annotations

import pytest

from axplug_testing._util import require

__all__ = ["STORAGE_CAPABILITIES", "StorageConformance"]

STORAGE_CAPABILITIES = (
    "checkpoint",  # a Checkpointer on `root_url` saves, lists, restores and prunes through it
)


class StorageConformance:
    """Subclass as `TestMyStorage(StorageConformance)`; override `storage` and `root_url`.

    `root_url` is an empty, writable URL of the backend's scheme (default: a local temporary
    directory, right for the core's LocalStorage); every check works below it.
    """

    capabilities: tuple[str, ...] = STORAGE_CAPABILITIES

    @pytest.fixture
    def storage(self):
        raise NotImplementedError(
            f"{type(self).__name__}: override the `storage` fixture to return your backend"
        )

    @pytest.fixture
    def root_url(self, tmp_path) -> str:
        return str(tmp_path / "storage-root")

    def test_capabilities_are_known(self):
        unknown = set(self.capabilities) - set(STORAGE_CAPABILITIES)
        assert not unknown, f"unknown capabilities {sorted(unknown)}; known: {STORAGE_CAPABILITIES}"

    def test_write_read_round_trip_creates_parents(self, storage, root_url):
        url = storage.join(root_url, "a", "b", "note.txt")
        assert not storage.exists(url)
        storage.write_text(url, "héllo ✓\nsecond line")
        assert storage.exists(url)
        assert storage.exists(storage.join(root_url, "a", "b"))
        assert storage.read_text(url) == "héllo ✓\nsecond line"
        storage.write_text(url, "replaced")
        assert storage.read_text(url) == "replaced", "write_text must overwrite"

    def test_read_missing_is_file_not_found(self, storage, root_url):
        with pytest.raises(FileNotFoundError):
            storage.read_text(storage.join(root_url, "missing.txt"))

    def test_listdir_gives_names_of_direct_children(self, storage, root_url):
        assert storage.listdir(storage.join(root_url, "nothing-here")) == []
        for name in ("b.txt", "a.txt", "sub/deep.txt"):
            storage.write_text(storage.join(root_url, *name.split("/")), name)
        assert sorted(storage.listdir(root_url)) == ["a.txt", "b.txt", "sub"]

    def test_delete_file_tree_and_missing(self, storage, root_url):
        storage.write_text(storage.join(root_url, "keep.txt"), "k")
        storage.write_text(storage.join(root_url, "gone.txt"), "g")
        storage.write_text(storage.join(root_url, "tree", "x", "y.txt"), "y")
        storage.delete(storage.join(root_url, "gone.txt"))
        storage.delete(storage.join(root_url, "tree"))
        storage.delete(storage.join(root_url, "never-existed"))  # no error
        assert sorted(storage.listdir(root_url)) == ["keep.txt"]
        assert not storage.exists(storage.join(root_url, "tree", "x", "y.txt"))

    def test_join_appends_components(self, storage, root_url):
        assert storage.join(root_url, "a", "b").endswith("/a/b")
        assert storage.join(root_url + "/", "a") == storage.join(root_url, "a")

    def test_path_is_what_orbax_writes(self, storage, root_url):
        path = storage.path(storage.join(root_url, "via-path"))
        path.mkdir(parents=True, exist_ok=True)
        (path / "f.txt").write_text("from epath")
        assert storage.read_text(storage.join(root_url, "via-path", "f.txt")) == "from epath"

    def test_checkpoint_save_restore_and_partial_writes(self, storage, root_url):
        require(self, "checkpoint", STORAGE_CAPABILITIES)
        import jax
        import jax.numpy as jnp
        import numpy as np

        from axplug.checkpoint import Checkpointer, layout

        directory = storage.join(root_url, "ckpt")
        ckpt = (
            Checkpointer.default_config()
            .set(directory=directory, keep_last=2, async_save=False)
            .instantiate()
        )
        try:
            assert type(ckpt.storage) is type(storage), (
                f"{directory} resolves to {type(ckpt.storage).__name__}: register the backend "
                "under its URL scheme in the axplug.storage entry-point group"
            )
            state = {"w": jnp.arange(6.0).reshape(2, 3), "step": jnp.asarray(0)}
            for step in (1, 2, 3):
                ckpt.save(step, jax.tree.map(lambda x, s=step: x + s, state), {"step": step})
            ckpt.wait_until_finished()
            assert ckpt.all_steps() == [2, 3], "keep_last=2 must delete step 1"
            # A step directory without the commit marker is a partial write: never listed.
            partial = storage.join(directory, layout.step_dir_name(7))
            storage.write_text(storage.join(partial, "half.txt"), "interrupted")
            assert ckpt.all_steps() == [2, 3] and ckpt.latest_step() == 3
            target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
            step, restored, metadata = ckpt.restore(target=target)
            assert step == 3 and metadata["step"] == 3
            np.testing.assert_array_equal(restored["w"], state["w"] + 3)
        finally:
            ckpt.close()
