from pathlib import Path

import pytest

from pie.config import BackendConfig, ConfigError, PieConfig, ServerConfig, load_config

ROOT = Path(__file__).resolve().parents[1]


def test_default_toml_matches_dataclass_defaults():
    assert load_config(ROOT / "configs" / "default.toml") == PieConfig()


def test_partial_file_overrides_only_its_keys(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[backend]\npage_size = 32\ndtype = "float32"\n')
    config = load_config(path)
    assert config.backend.page_size == 32 and config.backend.dtype == "float32"
    assert config.backend.num_kv_pages == BackendConfig().num_kv_pages


@pytest.mark.parametrize(
    "text, message",
    [
        ("[backend]\npage_sise = 8\n", "unknown config key backend.page_sise"),
        ('[backend]\npage_size = "16"\n', "backend.page_size must be int"),
        ('[backend]\ndtype = "fp8"\n', "backend.dtype must be one of"),
        ("[backend]\nnum_kv_pages = 0\n", "num_kv_pages must be positive"),
        ("[model]\npath = [1]\n", "model.path must be str"),
        ("backend = 3\n", "backend must be a table"),
        ("[backend\n", "not valid TOML"),
        ("[quota.user]\nkv_pages = -1\n", "quota keys must be >= 0"),
        ("[quota.instance]\nqueue = 3\n", "unknown config key quota.instance.queue"),
        ('[control]\nkv_pressure = "kill"\n', "control.kv_pressure must be one of min-waste, swap, discard, preserve, wait, terminate-newest"),
        ('[control]\nkv_pressure = "terminate-newest"\nalloc_wait_ms = 0\n', "needs control.alloc_wait_ms > 0"),
        ("[server]\ndrain_timeout_s = -1\n", "server.drain_timeout_s must be >= 0"),
        ("[server]\nmax_pending_messages = 0\n", "max_pending_messages must be positive"),
        ("[control]\nstream_interval = 0\n", "stream_interval must be positive"),
        ("[control]\nprefill_batch_tokens = 32\n", r"prefill_batch_tokens \(32\) must be at least control.max_step_tokens"),
    ],
)
def test_bad_config_is_a_clear_error(tmp_path, text, message):
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_missing_config_file():
    with pytest.raises(ConfigError, match="config file not found"):
        load_config("/nonexistent/pie.toml")


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.10", "example.com"])
def test_non_loopback_hosts_require_authentication(host):
    with pytest.raises(ConfigError, match="authentication is required"):
        ServerConfig(host=host)
    assert ServerConfig(host=host, auth_tokens=["secret-token-00001"]).host == host
    assert ServerConfig(host=host, allow_unauthenticated=True).host == host
    for loopback in ("127.0.0.1", "::1", "localhost"):
        assert ServerConfig(host=loopback).auth_tokens == []
