"""The command line's own edges: every option documented, bad ports refused before the model loads."""

import socket
import subprocess
import sys

from hylo.cli import build_parser


def test_every_option_has_help_text():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, p in sub.choices.items():
        for action in p._actions:
            if action.dest in ("help",):
                continue
            assert action.help and action.help.strip(), (name, action.option_strings or action.dest)


def test_bad_and_busy_ports_are_refused_before_loading():
    out = subprocess.run([sys.executable, "-m", "hylo", "serve", "--port", "99999"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "port 99999" in out.stderr and "[hylo] model" not in out.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "hylo", "serve", "--port", str(port)], capture_output=True,
                             text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"port {port}" in out.stderr and "in use" in out.stderr and "[hylo] model" not in out.stderr


def test_an_api_key_that_would_let_anyone_in_is_refused_before_loading():
    """An empty key matched 'Authorization: Bearer' with nothing after it; a key with spaces around it or of
    non-ASCII text could never be sent and matched."""
    from hylo.server.app import check_api_key

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run([sys.executable, "-m", "hylo", "serve", "--port", str(port), "--api-key", ""],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "--api-key" in out.stderr and "[hylo] model" not in out.stderr
    for key in ("", " k", "k ", "clé"):
        try:
            check_api_key(key)
            raise AssertionError(f"accepted {key!r}")
        except ValueError as e:
            assert "--api-key" in str(e)
    check_api_key("sk-test_1.2")
    check_api_key(None)


def test_bench_replay_sizes_below_one_are_refused_by_name():
    import pytest

    for option, value in (("--turns", "-1"), ("--turns", "0"), ("--conversations", "0"), ("--conversations", "x")):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["bench", "--prefix-replay", option, value])
    args = build_parser().parse_args(["bench", "--prefix-replay", "--turns", "2", "--conversations", "3"])
    assert (args.turns, args.conversations) == (2, 3)


def test_generate_with_a_constraint(tmp_path):
    """``hylo generate --json-schema @FILE`` / ``--regex``: the printed completion follows the constraint; a bad
    one is refused in one line, without a traceback."""
    import json
    import re

    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}))
    prompt = "x = "
    out = subprocess.run([sys.executable, "-m", "hylo", "generate", prompt, "--json-schema", f"@{schema}",
                          "--max-tokens", "40"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) in ({"ok": True}, {"ok": False})  # piped: the completion alone
    out = subprocess.run([sys.executable, "-m", "hylo", "generate", prompt, "--regex", "[0-9]{2}", "--max-tokens",
                          "8"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and re.fullmatch(r"[0-9]{2}", out.stdout.strip()), out
    out = subprocess.run([sys.executable, "-m", "hylo", "generate", prompt, "--json-schema", "{nope"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "not valid JSON" in out.stderr and "Traceback" not in out.stderr
