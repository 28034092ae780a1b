"""hkv/config.py: the CLI's flags, their help, the model description and the config's JSON round trip."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import tempfile

import pytest

from hkv.config import ConfigError, HkvConfig, KeyHash, build_parser, parse_cli
from tests.openai.tokenizer_fixture import tiny_dense_folder

# DESIGN.md section 6: the public flag names
CONTRACT_FLAGS = """--model --host --port --name --device --dtype --tp --page-size --max-total-tokens
--max-running-requests --chunked-prefill-size --checkpoint-interval --state-slots --no-prefix-cache
--cpu-cache-gb --disk-cache-dir --disk-cache-gb --spec-tokens --draft-window --mode --prefill-url
--decode-url --secret-file --api-key --api-key-file --admin-key --request-timeout --no-cuda-graph
--cuda-graph-max-bs --gpu-memory-fraction --seed --log-level""".split()


def _flags():
    return [a for a in build_parser()._actions if a.option_strings and a.dest != "help"]


def test_every_contract_flag_exists_and_has_help_with_its_default():
    flags = {a.option_strings[0]: a for a in _flags()}
    assert set(CONTRACT_FLAGS) <= set(flags)
    for name, action in flags.items():
        assert action.help and re.search(r"\(default: [^)]+\)", action.help), name


def test_help_groups_the_flags():
    text = build_parser().format_help()
    for group in ("model:", "cache:", "tiers:", "scheduling:", "server:", "prefill/decode disaggregation:",
                  "security:"):
        assert group in text
    pending: set[str] = set()
    for action in _flags():
        said = "not implemented yet" in action.help.lower()
        assert said == (action.option_strings[0] in pending), action.option_strings[0]


@pytest.mark.parametrize("argv, message", [
    (["--tp", "3"], "--tp 3 does not divide the model's 4 attention heads"),
    (["--tp", "2", "--mode", "prefill", "--secret-file", "x"], "prefill/decode instances run one rank"),
    (["--tp", "2", "--quantize", "fp8"], "FP8 weights run on one rank"),
])
def test_tp_the_model_or_mode_cannot_take_is_refused(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_cli(["--device", "cpu", *argv])


def _qwen3_5_folder(tmp_path, **extra):
    text = dict(model_type="qwen3_5_text", vocab_size=1536, hidden_size=32, num_hidden_layers=4,
                num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=1024,
                full_attention_interval=2, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4)
    text.update(extra)
    (tmp_path / "config.json").write_text(json.dumps(text))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_dense_folder() / name, tmp_path / name)
    return tmp_path


def test_a_config_with_only_full_attention_interval_is_hybrid(tmp_path):
    cfg = parse_cli(["--device", "cpu", "--model", str(_qwen3_5_folder(tmp_path)), "--max-running-requests", "4"])
    shutil.rmtree(cfg.run_dir)
    assert cfg.cache.hybrid and cfg.model.spec.hybrid
    assert cfg.model.spec.layer_kinds == ("linear", "full", "linear", "full")
    assert cfg.cache.state_slots == 12 and cfg.cache.checkpoint_interval == 256
    assert cfg.model.max_context == 1024 and cfg.model.spec.vocab_size == 1536


def test_config_json_round_trip_keeps_every_field(tmp_path):
    cfg = parse_cli(["--device", "cpu", "--model", str(_qwen3_5_folder(tmp_path)), "--cpu-cache-gb", "0.5",
                     "--disk-cache-dir", str(tmp_path / "disk")])
    shutil.rmtree(cfg.run_dir)
    again = HkvConfig.from_json(cfg.to_json())
    assert again == cfg and isinstance(again.model.spec.layer_kinds, tuple)
    assert again.cache.disk_cache_gb == 16.0


def test_a_model_it_cannot_describe_exits_with_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match="unsupported model_type 'llama'"):
        parse_cli(["--device", "cpu", "--model", str(tmp_path)])


def test_graph_and_memory_flags(tmp_path):
    folder = str(_qwen3_5_folder(tmp_path))
    cfg = parse_cli(["--device", "cpu", "--model", folder, "--cuda-graph-max-bs", "8", "--gpu-memory-fraction", "0.5"])
    shutil.rmtree(cfg.run_dir)
    assert cfg.model.cuda_graph_max_bs == 0  # graphs are CUDA only
    assert cfg.cache.gpu_memory_fraction == 0.5 and cfg.cache.max_total_tokens == 32768
    with pytest.raises(ConfigError, match="contradict"):
        parse_cli(["--device", "cpu", "--model", folder, "--cuda-graph-max-bs", "8", "--no-cuda-graph"])
    with pytest.raises(SystemExit):
        parse_cli(["--device", "cpu", "--model", folder, "--gpu-memory-fraction", "1.5"])


def test_the_prefix_wait_flag(tmp_path):
    folder = str(_qwen3_5_folder(tmp_path))
    for argv, tokens in (([], 256), (["--prefix-wait-tokens", "0"], 0), (["--prefix-wait-tokens", "1024"], 1024)):
        cfg = parse_cli(["--device", "cpu", "--model", folder, *argv])
        shutil.rmtree(cfg.run_dir)
        assert cfg.scheduler.prefix_wait_tokens == tokens
    with pytest.raises(SystemExit):
        parse_cli(["--device", "cpu", "--model", folder, "--prefix-wait-tokens", "-1"])


def test_the_grammar_threads_flag(tmp_path, capsys):
    folder = str(_qwen3_5_folder(tmp_path))
    for argv, threads in (([], 0), (["--grammar-threads", "1"], 1), (["--grammar-threads", "256"], 256)):
        cfg = parse_cli(["--device", "cpu", "--model", folder, *argv])
        shutil.rmtree(cfg.run_dir)
        assert cfg.scheduler.grammar_threads == threads
        assert HkvConfig.from_json(cfg.to_json()).scheduler.grammar_threads == threads
    for bad in ("0", "257", "-3", "two"):
        capsys.readouterr()
        with pytest.raises(SystemExit) as failure:
            parse_cli(["--device", "cpu", "--model", folder, "--grammar-threads", bad])
        err = capsys.readouterr().err
        assert failure.value.code == 2 and len(err.strip().splitlines()) == 1 and "--grammar-threads" in err, err


def _qwen3_5_9b_folder(tmp_path):
    """Qwen3.5-9B's cache-relevant shape (docs/sizing.md): 8 of 32 layers full attention, 4 KV heads x 256,
    GDN with 16 key heads x 128 and 32 value heads x 128, kernel 4."""
    return _qwen3_5_folder(tmp_path, hidden_size=64, num_hidden_layers=32, full_attention_interval=4,
                           num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                           linear_key_head_dim=128, linear_value_head_dim=128)


@pytest.mark.parametrize(("dtype", "interval"), [("bfloat16", 1792), ("float32", 1024)])
def test_the_tier_checkpoint_interval_defaults_to_where_a_checkpoint_costs_its_span(tmp_path, dtype, interval):
    """A 50.25 MiB checkpoint is the bf16 KV of 1,608 tokens: 7 intervals of 256 (4 at fp32's 804)."""
    cfg = parse_cli(["--device", "cpu", "--dtype", dtype, "--model", str(_qwen3_5_9b_folder(tmp_path)),
                     "--cpu-cache-gb", "1", "--max-running-requests", "4"])
    shutil.rmtree(cfg.run_dir)
    assert (cfg.cache.checkpoint_interval, cfg.cache.tier_checkpoint_interval) == (256, interval)


def test_the_tier_checkpoint_interval_is_a_multiple_for_hybrid_models_with_tiers(tmp_path):
    folder = str(_qwen3_5_folder(tmp_path))
    base = ["--device", "cpu", "--model", folder, "--max-running-requests", "4"]
    cfg = parse_cli([*base, "--cpu-cache-gb", "1", "--tier-checkpoint-interval", "768"])
    shutil.rmtree(cfg.run_dir)
    assert cfg.cache.tier_checkpoint_interval == 768
    cfg = parse_cli(base)
    shutil.rmtree(cfg.run_dir)
    assert cfg.cache.tier_checkpoint_interval is None  # no tiers
    with pytest.raises(ConfigError, match=r"must be a multiple of --checkpoint-interval \(256\)"):
        parse_cli([*base, "--cpu-cache-gb", "1", "--tier-checkpoint-interval", "300"])
    with pytest.raises(ConfigError, match="needs --cpu-cache-gb"):
        parse_cli([*base, "--tier-checkpoint-interval", "512"])
    with pytest.raises(ConfigError, match="hybrid models only"):
        parse_cli(["--device", "cpu", "--model", str(tiny_dense_folder()), "--cpu-cache-gb", "1",
                   "--tier-checkpoint-interval", "512"])


@pytest.mark.parametrize("page, interval, default", [(16, None, 256), (1, None, 64), (4, None, 64), (32, None, 512),
                                                     (48, None, 768), (16, "64", 64), (48, "192", 192)])
def test_the_checkpoint_interval_is_a_multiple_of_the_page_and_the_gdn_chunk(tmp_path, page, interval, default):
    flags = ["--page-size", str(page)] + (["--checkpoint-interval", interval] if interval else [])
    cfg = parse_cli(["--device", "cpu", "--model", str(_qwen3_5_folder(tmp_path)), *flags])
    shutil.rmtree(cfg.run_dir)
    assert cfg.cache.checkpoint_interval == default


@pytest.mark.parametrize("page, interval, align", [(16, 32, 64), (16, 80, 64), (48, 96, 192)])
def test_an_interval_off_the_gdn_chunk_is_refused(tmp_path, page, interval, align):
    with pytest.raises(ConfigError, match=f"--checkpoint-interval \\({interval}\\) must be a multiple of {align}"):
        parse_cli(["--device", "cpu", "--model", str(_qwen3_5_folder(tmp_path)), "--page-size", str(page),
                   "--checkpoint-interval", str(interval)])


def test_keys_reach_the_config_only_as_salted_hashes(tmp_path, monkeypatch):
    monkeypatch.setenv("HKV_METRICS_KEY", "metrics-secret")
    key_file = tmp_path / "key"
    key_file.write_text("file-secret\n")
    cfg = parse_cli(["--device", "cpu", "--model", "tiny-dense", "--api-key-file", str(key_file),
                     "--admin-key", "admin-secret", "--request-timeout", "5", "--max-connections", "10"])
    shutil.rmtree(cfg.run_dir)
    text = cfg.to_json()
    for secret in ("file-secret", "admin-secret", "metrics-secret"):
        assert secret not in text
    server = HkvConfig.from_json(text).server
    assert server.api_key.matches("file-secret") and not server.api_key.matches("file-secret ")
    assert server.admin_key.matches("admin-secret") and not server.admin_key.matches("file-secret")
    assert server.metrics_key.matches("metrics-secret")
    assert (server.request_timeout_s, server.max_connections) == (5.0, 10)
    assert KeyHash.of("same").salt != KeyHash.of("same").salt


@pytest.mark.parametrize("argv, fragment", [
    (["--api-key", "a", "--api-key-file", "/etc/hostname"], "not both"),
    (["--api-key-file", "/nonexistent/key"], "--api-key-file /nonexistent/key"),
    (["--api-key", "has space"], "without spaces"),
    (["--request-timeout", "0"], None),
])
def test_bad_key_or_timeout_flags_exit_2(argv, fragment, capsys):
    with pytest.raises((ConfigError, SystemExit)) as failure:
        parse_cli(["--device", "cpu", "--model", "tiny-dense", *argv])
    if fragment is not None:
        assert fragment in str(failure.value)


def test_cuda_state_slots_are_left_to_the_rank_unless_given():
    from hkv.config import _resolve_checkpoints

    def resolve(on_cpu, **flags):
        args = argparse.Namespace(**{"checkpoint_interval": None, "state_slots": None, "page_size": 16,
                                     "no_prefix_cache": False, "model": "m", **flags})
        return _resolve_checkpoints(args, True, 64, on_cpu)

    assert resolve(False) == (256, None)  # sized from GPU memory by the rank
    assert resolve(True) == (256, 192)  # CPU: 3 x running
    assert resolve(False, state_slots=100) == (256, 100)
    with pytest.raises(ConfigError, match="must exceed"):
        resolve(False, state_slots=64)


def _secret(tmp_path, mode=0o600, size=32):
    path = tmp_path / "pd.secret"
    path.write_bytes(b"s" * size)
    path.chmod(mode)
    return str(path)


@pytest.mark.parametrize("argv, message", [
    (["--mode", "decode", "--cpu-cache-gb", "0.01"], "--mode decode needs --secret-file"),
    (["--mode", "prefill", "--cpu-cache-gb", "0", "SECRET"], "stages transfers in the CPU tier"),
    (["--mode", "decode", "--cpu-cache-gb", "0.01", "--no-prefix-cache", "SECRET"], "--cpu-cache-gb needs the prefix"),
    (["--mode", "pd-master", "--prefill-url", "http://127.0.0.1:1", "SECRET"], "at least one --prefill-url and one"),
    (["--prefill-url", "http://127.0.0.1:1"], "pd-master flags"),
    (["--mode", "pd-master", "--prefill-url", "ftp://x", "--decode-url", "http://127.0.0.1:2", "SECRET"],
     "want http://host:port"),
    (["--mode", "prefill", "--cpu-cache-gb", "0.01", "--pd-port", "70000", "SECRET"], "--pd-port must be in"),
])
def test_pd_flag_combinations_exit_with_one_line(tmp_path, argv, message):
    argv = [a if a != "SECRET" else f"--secret-file={_secret(tmp_path)}" for a in argv]
    with pytest.raises(ConfigError, match=message):
        parse_cli(["--device", "cpu", *argv])


def test_a_secret_file_open_to_others_or_short_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="chmod 600"):
        parse_cli(["--device", "cpu", "--secret-file", _secret(tmp_path, mode=0o644)])
    with pytest.raises(ConfigError, match="at least 32"):
        parse_cli(["--device", "cpu", "--secret-file", _secret(tmp_path, size=8)])


def test_prefill_and_decode_stage_in_a_default_cpu_tier(tmp_path):
    """Issue 38: the pd quick start needs no --cpu-cache-gb; a normal instance keeps its tiers off."""
    from hkv.config import PD_STAGING_GB

    for mode in ("prefill", "decode"):
        cfg = parse_cli(["--device", "cpu", "--mode", mode, "--secret-file", _secret(tmp_path)])
        assert cfg.cache.cpu_cache_gb == PD_STAGING_GB == 2.0
    assert parse_cli(["--device", "cpu"]).cache.cpu_cache_gb == 0.0


def test_pd_modes_parse(tmp_path):
    secret = _secret(tmp_path)
    cfg = parse_cli(["--device", "cpu", "--mode", "decode", "--cpu-cache-gb", "0.01", "--secret-file", secret,
                     "--pd-port", "7001", "--pd-timeout", "5"])
    assert (cfg.server.mode, cfg.server.pd_port, cfg.server.pd_timeout_s) == ("decode", 7001, 5.0)
    assert cfg.server.secret_file == secret
    master = parse_cli(["--device", "cpu", "--mode", "pd-master", "--secret-file", secret, "--prefill-url",
                        "http://127.0.0.1:8001", "--decode-url", "http://127.0.0.1:8002"])
    assert master.server.prefill_urls == ("http://127.0.0.1:8001",)
    assert master.server.decode_urls == ("http://127.0.0.1:8002",)


@pytest.mark.parametrize("mode, device, transfer, tp, spec, backend", [
    ("decode", "cpu", "auto", 1, 0, ""),  # on CPU the CPU tier, unless asked
    ("decode", "cpu", "pair", 1, 0, "gloo"),
    ("prefill", "cpu", "pair", 1, 0, "gloo"),
    ("prefill", "cuda", "auto", 1, 0, "nccl"),
    ("decode", "cuda", "pair", 1, 0, "nccl"),
    ("decode", "cuda", "tier", 1, 0, ""),
    ("normal", "cpu", "pair", 1, 0, ""),  # only prefill and decode instances move prompts
    ("decode", "cpu", "pair", 2, 0, ""),  # one rank a side
    ("decode", "cuda", "auto", 1, 2, ""),  # a drafter's window travels on the CPU path only
])
def test_the_pair_backend_is_picked_at_start_up(mode, device, transfer, tp, spec, backend):
    from hkv.pd_flags import pair_backend

    assert pair_backend(mode, device, transfer, tp, spec) == backend


def test_pd_transfer_parses_and_refuses_a_path_it_does_not_know(tmp_path, capsys):
    secret = _secret(tmp_path)
    base = ["--device", "cpu", "--mode", "prefill", "--cpu-cache-gb", "0.01", "--secret-file", secret]
    assert parse_cli(base).server.pd_transfer == "auto"
    cfg = parse_cli([*base, "--pd-transfer", "pair"])
    assert (cfg.server.pd_transfer, cfg.pair_backend) == ("pair", "gloo")
    with pytest.raises(SystemExit):
        parse_cli([*base, "--pd-transfer", "rdma"])
    assert "invalid choice: 'rdma'" in capsys.readouterr().err


def _mkdir(path):
    path.mkdir()
    return path


def _compile_cache(argv: list[str], folder) -> str:
    cfg = parse_cli(["--device", "cpu", "--model", str(folder), *argv])
    shutil.rmtree(cfg.run_dir)
    return cfg.model.compile_cache_dir


def test_the_compile_cache_goes_to_the_users_cache_folder_by_default_created_private(tmp_path, monkeypatch):
    folder = _qwen3_5_folder(_mkdir(tmp_path / "model"))
    monkeypatch.setenv("HKV_CACHE_DIR", str(tmp_path / "builtin"))  # the built-in models' folder only
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _compile_cache([], folder) == str(tmp_path / "xdg" / "hkv" / "compile")
    assert (tmp_path / "xdg" / "hkv" / "compile").stat().st_mode & 0o777 == 0o700
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert _compile_cache([], folder) == str(tmp_path / "home" / ".cache" / "hkv" / "compile")


def test_the_compile_cache_flag_and_the_environment_a_rank_compiles_under(tmp_path):
    folder = _qwen3_5_folder(_mkdir(tmp_path / "model"))
    target = tmp_path / "deep" / "cc"
    cfg = parse_cli(["--device", "cpu", "--model", str(folder), "--compile-cache-dir", str(target)])
    shutil.rmtree(cfg.run_dir)
    assert cfg.model.compile_cache_dir == str(target) and target.stat().st_mode & 0o777 == 0o700
    assert cfg.model.compile_env() == {"TRITON_CACHE_DIR": str(target / "triton"), "TRITON_CACHE_AUTOTUNING": "1"}
    assert HkvConfig.from_json(cfg.to_json()).model.compile_cache_dir == str(target)


def test_a_compile_cache_others_could_write_or_that_is_a_file_exits_2(tmp_path):
    folder = _qwen3_5_folder(_mkdir(tmp_path / "model"))
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # another user could plant kernels the ranks would load
    with pytest.raises(ConfigError, match="writable by no one else .* mode 777"):
        parse_cli(["--device", "cpu", "--model", str(folder), "--compile-cache-dir", str(shared)])
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="exists and is not a directory"):
        parse_cli(["--device", "cpu", "--model", str(folder), "--compile-cache-dir", str(tmp_path / "file")])


def test_the_start_up_stall_is_read_from_the_environment(tmp_path, monkeypatch):
    folder = _qwen3_5_folder(_mkdir(tmp_path / "model"))
    monkeypatch.setenv("HKV_STARTUP_STALL_S", "2.5")
    cfg = parse_cli(["--device", "cpu", "--model", str(folder)])
    shutil.rmtree(cfg.run_dir)
    assert cfg.server.startup_stall_s == 2.5


def test_fp8_kv_resolves_on_either_device():
    """--kv-cache-dtype fp8_e4m3 is float8_e4m3fn pages on CPU and CUDA alike (the resolver takes no device);
    auto is the model's dtype ("")."""
    from hkv.config import _resolve_kv_dtype

    assert _resolve_kv_dtype("fp8_e4m3") == "float8_e4m3fn" and _resolve_kv_dtype("auto") == ""


def _schedulers_under(monkeypatch, folder: str, variable: str, value: str | None):
    """The scheduler config parse_cli makes with $variable set to value (None: unset), and the same config after
    a round trip through its JSON (what a rank reads)."""
    if value is None:
        monkeypatch.delenv(variable, raising=False)
    else:
        monkeypatch.setenv(variable, value)
    cfg = parse_cli(["--device", "cpu", "--model", folder])
    shutil.rmtree(cfg.run_dir)
    return cfg.scheduler, HkvConfig.from_json(cfg.to_json()).scheduler


def test_the_grammar_device_wait_comes_from_its_variable_only_when_1(tmp_path, monkeypatch):
    folder = str(_qwen3_5_folder(tmp_path))
    for value, on in ((None, False), ("0", False), ("yes", False), ("1", True)):
        parsed, read = _schedulers_under(monkeypatch, folder, "HKV_GRAMMAR_DEVICE_WAIT", value)
        assert parsed.grammar_device_wait is on
        assert read.grammar_device_wait is on


def test_the_grammar_mask_cache_is_on_unless_its_variable_says_0_or_verify(tmp_path, monkeypatch):
    folder = str(_qwen3_5_folder(tmp_path))
    for value, mode in ((None, "on"), ("1", "on"), ("0", "off"), ("verify", "verify")):
        parsed, read = _schedulers_under(monkeypatch, folder, "HKV_GRAMMAR_MASK_CACHE", value)
        assert parsed.grammar_mask_cache == mode
        assert read.grammar_mask_cache == mode
    runs = tmp_path / "runs"  # where parse_cli's run directories go here: none may be left by a refused start
    runs.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(runs))
    for typo in ("yes", "off", "2"):  # a value it does not know is an error naming the variable, not a guess
        monkeypatch.setenv("HKV_GRAMMAR_MASK_CACHE", typo)
        with pytest.raises(ConfigError, match=f"HKV_GRAMMAR_MASK_CACHE='{typo}'"):
            parse_cli(["--device", "cpu", "--model", folder])
    monkeypatch.setenv("HKV_GRAMMAR_MASK_CACHE", "1")
    monkeypatch.setenv("HKV_PROFILE_STEPS", "0")
    with pytest.raises(ConfigError, match="HKV_PROFILE_STEPS"):
        parse_cli(["--device", "cpu", "--model", folder])
    assert list(runs.iterdir()) == []


def test_the_step_profile_comes_from_its_variables(tmp_path, monkeypatch):
    """$HKV_PROFILE_STEPS: decode batch sizes (sorted, deduplicated) up to --max-running-requests, with
    $HKV_PROFILE_DIR made absolute; a malformed or out-of-range list is a ConfigError naming the variable."""
    folder = str(_qwen3_5_folder(tmp_path))
    monkeypatch.chdir(tmp_path)

    def model_under(steps: str | None, folder_var: str | None = None):
        for name, value in (("HKV_PROFILE_STEPS", steps), ("HKV_PROFILE_DIR", folder_var)):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        cfg = parse_cli(["--device", "cpu", "--model", folder, "--max-running-requests", "8"])
        shutil.rmtree(cfg.run_dir)
        return cfg.model, HkvConfig.from_json(cfg.to_json()).model

    for parsed in model_under(None):
        assert parsed.profile_rows == () and parsed.profile_dir == ""
    for parsed in model_under("8, 1,1", "profiles"):
        assert parsed.profile_rows == (1, 8) and parsed.profile_dir == str(tmp_path / "profiles")
    for bad, message in (("1,x", "decode batch sizes separated by commas"), ("0", "from 1 to"), ("9", r"\(8\)")):
        with pytest.raises(ConfigError, match=rf"HKV_PROFILE_STEPS='{bad}'.*{message}"):
            model_under(bad)
