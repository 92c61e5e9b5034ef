"""Config written once: every option field is a flag and an LLM keyword; bad values are usage errors."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys

import pytest

from harness.server import REPO_ROOT
from titan.config import DEFAULT_SLO_ITL_MS, AdmissionConfig, CacheConfig, EngineConfig, SchedulerConfig
from titan.config_flags import FLAG_NAMES, add_engine_arguments, engine_config, engine_config_from_args


def test_every_option_field_has_a_flag_with_its_default() -> None:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    defaults = vars(parser.parse_args([]))
    for cls in (EngineConfig, CacheConfig, SchedulerConfig, AdmissionConfig):
        for field in dataclasses.fields(cls):
            if field.name in ("cache", "scheduler", "admission"):
                continue
            assert "help" in field.metadata, f"{cls.__name__}.{field.name} has no flag"
            name = field.metadata["flag"] or field.name
            assert name in FLAG_NAMES and defaults[name] == field.default
    assert engine_config_from_args(parser.parse_args([])) == EngineConfig()


def test_flags_and_keywords_build_the_same_nested_config() -> None:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--block-size", "8", "--kv-cache-memory", "0.5", "--scheduling-policy", "priority",
                              "--min-prefill-chunk", "32", "--no-enable-prefix-caching", "--admit-long-prompts",
                              "--kv-cache-dtype", "float16"])
    config = engine_config_from_args(args)
    assert config == engine_config(block_size=8, kv_cache_memory=0.5, scheduling_policy="priority",
                                   min_prefill_chunk=32, enable_prefix_caching=False, admit_long_prompts=True,
                                   kv_cache_dtype="float16")
    assert config.cache.kv_cache_dtype == "float16"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        engine_config(kv_cache_dtype="fp8")
    assert (config.cache.block_size, config.cache.kv_cache_memory_gib, config.cache.enable_prefix_caching) == (
        8, 0.5, False)
    assert (config.scheduler.policy, config.scheduler.min_prefill_chunk) == ("priority", 32)
    assert config.admission.admit_long_prompts
    with pytest.raises(TypeError, match="max_num_seq"):
        engine_config(max_num_seq=4)  # a typo is an error, not a silently ignored keyword


def test_slo_policy_alone_gets_the_documented_step_target() -> None:
    assert SchedulerConfig(policy="slo").itl_slo_ms == DEFAULT_SLO_ITL_MS
    assert SchedulerConfig(policy="slo", itl_slo_ms=80.0).itl_slo_ms == 80.0
    # No flags at all: slo with the automatic step target; fcfs has none.
    assert (SchedulerConfig().policy, SchedulerConfig().itl_slo_ms) == ("slo", DEFAULT_SLO_ITL_MS)
    assert SchedulerConfig(policy="fcfs").itl_slo_ms is None


@pytest.mark.parametrize(("flags", "message"), [
    (["--max-num-seqs", "0"], "max_num_seqs must be positive"),
    (["--scheduling-policy", "slo", "--itl-slo-ms", "-5"], "itl_slo_ms must be positive"),
    (["--scheduling-policy", "slo", "--itl-slo-ms", "soon"], "itl_slo_ms: could not convert"),
    (["--block-size", "many"], "invalid int value"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 99}'], "between 1 and 16"),
    (["--speculative-config", "ngram"], "not valid JSON"),
])
def test_a_bad_flag_value_is_a_usage_error_not_a_traceback(flags: list[str], message: str) -> None:
    result = subprocess.run([sys.executable, "-m", "titan.entrypoints.cli", "serve", *flags],
                            capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert result.returncode == 2
    assert message in result.stderr and "usage:" in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_conventions_version_positional_model_defaults_in_help(tmp_path) -> None:
    from titan.entrypoints.cli import parse_args

    version = subprocess.run([sys.executable, "-m", "titan.entrypoints.cli", "--version"], capture_output=True,
                             text=True, cwd=REPO_ROOT, timeout=120)
    assert version.returncode == 0 and version.stdout.startswith("titan ")
    assert parse_args(["serve", "my-model.gguf"]).engine_config.model == "my-model.gguf"  # as `vllm serve MODEL`
    assert parse_args(["serve", "--model", "other.gguf"]).engine_config.model == "other.gguf"
    help_text = subprocess.run([sys.executable, "-m", "titan.entrypoints.cli", "serve", "--help"],
                               capture_output=True, text=True, cwd=REPO_ROOT, timeout=120).stdout
    help_text = " ".join(help_text.split())  # argparse wraps to the terminal's width
    assert "(default: 512)" in help_text and "(default: hermes)" in help_text
    with pytest.raises(ValueError, match="chat_template"):
        EngineConfig(chat_template=str(tmp_path / "missing.jinja"))


def test_chat_template_flag_replaces_the_models_template(tmp_path) -> None:
    from titan import LLM

    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] ")
    llm = LLM("default", chat_template=str(template), kv_cache_memory=0.05)
    rendered = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "[user] hi\n[assistant] "
