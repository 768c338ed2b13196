"""The deployment secret: loading refuses unusable sources; MACs separate purposes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ascend_dist.common.errors import ConfigError
from ascend_dist.common.secret import (
    MIN_SECRET_BYTES,
    SECRET_ENV,
    SECRET_FILE_ENV,
    DeploymentSecret,
    load_secret,
    write_secret_file,
)


def test_no_variable_means_no_secret() -> None:
    assert load_secret({}) is None


def test_written_file_loads_and_signs(tmp_path: Path) -> None:
    path = tmp_path / "key"
    write_secret_file(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    secret = load_secret({SECRET_FILE_ENV: str(path)})
    assert secret is not None
    tag = secret.sign("frame", b"payload")
    assert secret.verify("frame", b"payload", tag)
    assert not secret.verify("frame", b"payload!", tag)
    # A tag for one purpose is not valid for another.
    assert not secret.verify("pull-capability", b"payload", tag)
    # The same file on another node gives the same key.
    again = load_secret({SECRET_FILE_ENV: str(path)})
    assert again is not None and again.verify("frame", b"payload", tag)
    assert "hidden" in repr(secret)


def test_write_refuses_to_overwrite(tmp_path: Path) -> None:
    path = tmp_path / "key"
    write_secret_file(path)
    with pytest.raises(FileExistsError):
        write_secret_file(path)


def test_file_readable_by_others_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "key"
    write_secret_file(path)
    path.chmod(0o644)
    with pytest.raises(ConfigError) as info:
        load_secret({SECRET_FILE_ENV: str(path)})
    assert info.value.field == SECRET_FILE_ENV


def test_symlinked_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "key"
    write_secret_file(path)
    link = tmp_path / "link"
    link.symlink_to(path)
    with pytest.raises(ConfigError):
        load_secret({SECRET_FILE_ENV: str(link)})


@pytest.mark.parametrize("value", ["zz", "ab" * (MIN_SECRET_BYTES - 1)])
def test_bad_inline_key_is_refused(value: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_secret({SECRET_ENV: value})
    assert info.value.field in (SECRET_ENV, "secret")


def test_two_sources_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "key"
    write_secret_file(path)
    with pytest.raises(ConfigError):
        load_secret({SECRET_FILE_ENV: str(path), SECRET_ENV: "ab" * MIN_SECRET_BYTES})


def test_different_keys_do_not_verify() -> None:
    a = DeploymentSecret(b"a" * MIN_SECRET_BYTES)
    b = DeploymentSecret(b"b" * MIN_SECRET_BYTES)
    assert not b.verify("frame", b"x", a.sign("frame", b"x"))
