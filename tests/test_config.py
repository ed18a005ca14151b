"""``tp_kernels.config``: a setting's override for a block."""

from __future__ import annotations

import pytest

from tp_kernels import config


def test_overriding_restores_what_was_before(monkeypatch):
    setting = config.Setting("TP_KERNELS_TEST_FLAG", False, config._parse_flag, config._check_flag)
    monkeypatch.setenv("TP_KERNELS_TEST_FLAG", "0")
    assert setting.get() is False  # the environment's value, read once
    monkeypatch.setenv("TP_KERNELS_TEST_FLAG", "1")
    assert setting.get() is False  # not read again: only the setting changes it
    before = config.generation()
    with setting.overriding(True):
        assert setting.get() is True
        assert config.generation() != before  # cached plans see the change
    assert setting.get() is False
    setting.set(True)
    with setting.overriding(False):
        assert setting.get() is False
    assert setting.get() is True  # the earlier override is back
    with pytest.raises(TypeError, match="flag: expected True or False"):
        with setting.overriding("yes", argument="flag"):
            pass
    assert setting.get() is True
