"""Commands from plugins: the `axplug.commands` entry-point group."""

from __future__ import annotations

import sys

import pytest

from axplug.cli.main import COMMANDS, main

HELLO = '''\
"""`axplug hello`: greets someone, from a plugin."""

import argparse


def add_parser(subparsers):
    parser = subparsers.add_parser("hello", help="greet someone")
    parser.add_argument("--name", default="world")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    print(f"hello {args.name}")
    return 0
'''


def _hello_site(site, modules=None, name="hello", value="fake_hello_cmd"):
    site.add(
        "fake-hello",
        {"axplug.commands": {name: value}},
        modules=modules or {"fake_hello_cmd": HELLO},
    )


def test_a_plugin_command_runs_and_is_listed_without_being_imported(plugin_site, capsys):
    _hello_site(plugin_site)
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "hello" in out and "greets someone, from a plugin" in out
    assert "fake_hello_cmd" not in sys.modules  # listed from its docstring, never imported
    assert main(["list", "--kind", "commands"]) == 0
    listed = capsys.readouterr().out
    assert "fake-hello" in listed and "train" in listed  # the core's commands are listed too
    assert main(["hello", "--name", "axplug"]) == 0
    assert capsys.readouterr().out == "hello axplug\n"
    assert main(["hello", "--help"]) == 0
    assert "--name" in capsys.readouterr().out


def test_the_core_registers_every_command_it_imports():
    from axplug import registry

    registry.reset()
    values = {c.value for c in registry.discover("commands") if c.distribution == "axplug"}
    assert values == set(COMMANDS)


def test_a_disabled_plugins_command_is_gone(plugin_site, capsys):
    _hello_site(plugin_site)
    assert main(["--disable", "fake-hello", "hello"]) == 2
    assert "invalid choice: 'hello'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("source", "value", "name", "message"),
    [
        ("raise RuntimeError('boom')\n", "fake_hello_cmd", "hello", "RuntimeError: boom"),
        ('"""No parser."""\n', "fake_hello_cmd", "hello", "has no add_parser(subparsers)"),
        (HELLO, "fake_hello_cmd", "greet", "did not add a command named 'greet'"),
    ],
)
def test_a_broken_plugin_command_is_one_clear_error(
    plugin_site, capsys, source, value, name, message
):
    _hello_site(plugin_site, {"fake_hello_cmd": source}, name=name, value=value)
    assert main([name]) == 1
    err = capsys.readouterr().err
    assert message in err and "fake-hello" in err
    assert main(["list", "--kind", "layers"]) == 0  # the rest of the CLI still works


def test_a_plugin_cannot_replace_a_core_command(plugin_site, capsys):
    _hello_site(plugin_site, name="train")
    assert main(["train", "--help"]) == 0
    assert "--preset" in capsys.readouterr().out  # still the core's `train`
    assert "fake_hello_cmd" not in sys.modules
    assert main(["list", "--kind", "commands", "--check"]) == 1
    assert "conflict: fake-hello registers commands 'train'" in capsys.readouterr().err
