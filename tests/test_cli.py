"""The `kvq` command line: the dispatcher, every command's --help, and `kvq demo` (text and --json)."""

from __future__ import annotations

import json

import pytest

from kvq import cli


def test_usage_and_unknown_command(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("demo", "eval", "calibrate", "bench", "figures"):
        assert name in out
    assert cli.main([]) == 2
    assert cli.main(["nosuch"]) == 2 and "unknown command 'nosuch'" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_every_command_has_help(name, capsys):
    try:                                   # argparse exits; some commands catch it and return the code
        rc = cli.main([name, "--help"])
    except SystemExit as e:
        rc = e.code
    assert rc == 0
    assert "usage: kvq" in capsys.readouterr().out


def test_demo_json_per_channel_keys_beat_per_token(capsys):
    """The demo's claim, checked on its own numbers: with outlier channels, per-channel key groups give a
    smaller key error and attention KL than per-token groups at the same bits."""
    assert cli.main(["demo", "--json", "--tokens", "256", "--no-gpu"]) == 0
    res = json.loads(capsys.readouterr().out)
    rows = {(r["configuration"].split(",")[0].strip(), r["bits"]): r for r in res["rows"]}
    for bits in (2, 4):
        pc, pt = rows[("K per-channel", bits)], rows[("K per-token", bits)]
        assert pc["k_rel_mse"] < pt["k_rel_mse"] and pc["attention_kl"] < pt["attention_kl"]
    assert len(res["outlier_channels"]) == 4


def test_demo_text_and_bad_tokens(capsys):
    assert cli.main(["demo", "--tokens", "128", "--no-gpu"]) == 0
    assert "Per-channel keys" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--tokens", "100"])
    assert e.value.code == 2
