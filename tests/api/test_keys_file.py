"""The API keys file: its format, and reloading it without ever losing the keys in force."""

from __future__ import annotations

import logging
import os
import threading

import pytest

from tinsmith.api.auth import Authenticator, owner_for_key, parse_keys
from tinsmith.errors import AuthError


def test_format_comments_blank_lines_and_hash_inside_keys():
    text = (
        "# tenants of this server\n"
        "\n"
        "tml-plain\n"
        "   # an indented comment\n"
        "tml-with#hash\n"          # '#' inside a key is part of it
        "tml-second  # inline comment after whitespace\n"
        "\ttml-tabbed\t#\ttab-separated comment\n"
        "tml-trailing-space   \n"
        "tml-ends-with#\n"
        "tml-comment-no-space #x\n"
    )
    assert parse_keys(text, "f") == ["tml-plain", "tml-with#hash", "tml-second", "tml-tabbed",
                                     "tml-trailing-space", "tml-ends-with#", "tml-comment-no-space"]


def test_anything_else_on_a_line_is_an_error_naming_it():
    with pytest.raises(ValueError, match=r"line 3: unexpected text after the key") as exc:
        parse_keys("# two keys on one line below\ntml-a\ntml-secret-b tml-secret-c\n", "'keys.txt'")
    assert "keys.txt" in str(exc.value)
    assert "secret" not in str(exc.value)  # keys are never echoed
    with pytest.raises(ValueError, match="line 1"):
        parse_keys("tml-a trailing-word # comment\n", "f")


def test_a_file_without_keys_is_an_error():
    with pytest.raises(ValueError, match="lists no keys"):
        parse_keys("# only comments\n\n   \n", "f")


def test_start_up_errors_are_clear(tmp_path):
    with pytest.raises(ValueError, match="cannot read api keys file"):
        Authenticator(str(tmp_path / "missing"))
    bad = tmp_path / "bad"
    bad.write_text("tml-a\ntml-b c\n")
    with pytest.raises(ValueError, match="line 2"):
        Authenticator(str(bad))


def _accepts(auth: Authenticator, key: str) -> bool:
    try:
        return auth.authenticate(key).owner == owner_for_key(key)
    except AuthError:
        return False


def _rewrite(path, text: str) -> None:
    path.write_text(text)
    st = path.stat()  # a distinct mtime even on a coarse-grained filesystem clock
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def test_reload_when_changed_and_keep_keys_on_failure(tmp_path, caplog):
    path = tmp_path / "keys"
    path.write_text("tml-one\n")
    auth = Authenticator(str(path))
    assert _accepts(auth, "tml-one") and not _accepts(auth, "tml-two")
    assert not auth.reload_if_changed()  # unchanged: not even read

    _rewrite(path, "tml-two # replaced one\n")
    assert auth.reload_if_changed()
    assert _accepts(auth, "tml-two") and not _accepts(auth, "tml-one")

    caplog.set_level(logging.ERROR, logger="tinsmith.api.auth")
    for broken in ("tml-three extra\n", "# nothing\n"):
        caplog.clear()
        _rewrite(path, broken)
        assert not auth.reload_if_changed()
        assert not auth.reload_if_changed()  # a file that stays broken is reported once
        assert len(caplog.records) == 1 and "keeping the 1 key(s)" in caplog.records[0].getMessage()
        assert _accepts(auth, "tml-two") and not _accepts(auth, "tml-three")

    caplog.clear()
    path.unlink()
    assert not auth.reload_if_changed() and not auth.reload_if_changed()
    assert len(caplog.records) == 1 and "cannot read" in caplog.records[0].getMessage()
    assert _accepts(auth, "tml-two")

    path.write_text("tml-four\n")
    assert auth.reload_if_changed()
    assert _accepts(auth, "tml-four") and not _accepts(auth, "tml-two")
    assert auth.multi_tenant


def test_a_broken_edit_is_reported_once_whether_the_poll_or_sighup_sees_it_first(tmp_path, caplog):
    path = tmp_path / "keys"
    path.write_text("tml-one\n")
    auth = Authenticator(str(path))
    caplog.set_level(logging.WARNING, logger="tinsmith.api.auth")

    _rewrite(path, "tml-two extra\n")
    assert not auth.reload_if_changed()  # the poll sees the edit first
    assert not auth.reload()  # then the SIGHUP sent for the same edit
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "unexpected text after the key" in errors[0].getMessage()
    assert "unchanged and still does not load" in caplog.records[-1].getMessage()

    for n in range(30):  # the poll and a SIGHUP reload race over the same edit: still one error each
        caplog.clear()
        _rewrite(path, f"tml-three extra {n}\n")
        racers = [threading.Thread(target=auth.reload_if_changed), threading.Thread(target=auth.reload)]
        for t in racers:
            t.start()
        for t in racers:
            t.join(5)
        assert [r.levelno for r in caplog.records if r.levelno >= logging.ERROR] == [logging.ERROR]

    caplog.clear()
    _rewrite(path, "tml-four\n")
    assert auth.reload() and _accepts(auth, "tml-four")
    _rewrite(path, "tml-four extra\n")
    assert not auth.reload()  # a new failure after a good load is an error again
    assert [r.levelno for r in caplog.records if r.levelno >= logging.WARNING] == [logging.ERROR]


def test_admin_word_marks_a_key_admin_and_nothing_else_is_accepted(tmp_path):
    from tinsmith.api.auth import parse_key_entries

    text = "tml-ops admin  # operators\ntml-user\ntml-two admin\n"
    assert parse_key_entries(text, "f") == [("tml-ops", True), ("tml-user", False), ("tml-two", True)]
    with pytest.raises(ValueError, match="line 1"):
        parse_key_entries("tml-ops admin extra\n", "f")
    with pytest.raises(ValueError, match="line 1"):
        parse_key_entries("tml-ops administrator\n", "f")
    keys = tmp_path / "keys"
    keys.write_text(text)
    auth = Authenticator(str(keys))
    ops, user = auth.authenticate("tml-ops"), auth.authenticate("tml-user")
    assert ops.admin and not user.admin
    assert ops.owner == owner_for_key("tml-ops")  # the same tenant as without the mark
    # Single-user mode has no admins: the one local owner sees its own runs, which are all runs.
    assert not Authenticator(None).authenticate("tml-anything").admin
