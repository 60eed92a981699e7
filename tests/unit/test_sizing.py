"""KV sizing: exact per-token/sequence bytes, concurrency, quantized figures, parse_bytes, CLI."""

import json

import pytest
import typer
from typer.testing import CliRunner

from cluster.core.sizing import format_bytes, parse_bytes, resolve_spec, size_report
from cluster.core.spec import ModelSpec
from cluster.tools.sizing_cli import size_command

GIB = 2**30
LLAMA_8B = ModelSpec.preset("llama-3.1-8b")
LLAMA_70B = ModelSpec.preset("llama-3.1-70b")


@pytest.fixture
def app() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def main() -> None:
        """Throwaway group, so `size` is a subcommand as in `raykv size`."""

    app.command("size")(size_command)
    return app


def run(app: typer.Typer, *args: str):
    return CliRunner().invoke(app, ["size", *args])


def test_bytes_per_token_presets():
    assert size_report(LLAMA_8B, 1, GIB)["bytes_per_token"] == 2 * 32 * 8 * 128 * 2 == 131072
    assert size_report(LLAMA_70B, 1, GIB)["bytes_per_token"] == 2 * 80 * 8 * 128 * 2 == 327680


def test_128k_sequence_bytes_and_concurrency():
    report = size_report(LLAMA_8B, 131072, 80 * GIB, page_tokens=256)
    assert report["pages_per_sequence"] == 512
    assert report["bytes_per_sequence"] == 131072 * 131072 == 16 * GIB
    assert report["sequences_fit"] == 5
    report_70b = size_report(LLAMA_70B, 131072, 80 * GIB)
    assert report_70b["bytes_per_sequence"] == 40 * GIB
    assert report_70b["sequences_fit"] == 2


def test_context_rounds_up_to_whole_pages_and_concurrency_floors():
    report = size_report(LLAMA_8B, 1000, 10**9, page_tokens=256)
    seq_bytes = 4 * 256 * 131072
    assert report["pages_per_sequence"] == 4
    assert report["bytes_per_sequence"] == seq_bytes
    assert report["sequences_fit"] == 10**9 // seq_bytes == 7
    assert size_report(LLAMA_8B, 1000, seq_bytes - 1)["sequences_fit"] == 0


def test_fp8_and_int8_roughly_halve_with_scale_overhead():
    report = size_report(LLAMA_8B, 131072, 80 * GIB)
    fp8, int8 = report["storage"]["fp8"], report["storage"]["int8"]
    scale_bytes = 4 * 2 * 32 * 8
    assert fp8["scale_bytes_per_page"] == scale_bytes
    assert fp8["bytes_per_token"] == 65536
    assert fp8["page_bytes"] == 256 * 65536 + scale_bytes
    assert fp8["bytes_per_sequence"] == 512 * (256 * 65536 + scale_bytes)
    assert 0.5 < fp8["ratio_vs_model_dtype"] < 0.501
    assert fp8["sequences_fit"] == 9  # the scales cost the tenth sequence
    assert int8["bytes_per_sequence"] == fp8["bytes_per_sequence"]
    native = report["storage"]["bfloat16"]
    assert not native["quantized"] and native["scale_bytes_per_page"] == 0
    assert list(report["storage"]) == ["bfloat16", "fp8", "int8"]


def test_dtype_override_changes_native_row():
    report = size_report(ModelSpec.preset("llama-3.1-8b", "float32"), 256, GIB)
    assert report["bytes_per_token"] == 262144
    assert 0.25 < report["storage"]["fp8"]["ratio_vs_model_dtype"] < 0.26
    native_int8 = size_report(LLAMA_8B.with_dtype("int8"), 256, GIB)["storage"]
    assert list(native_int8) == ["int8", "fp8"]
    assert native_int8["int8"]["scale_bytes_per_page"] == 0


def test_size_report_rejects_bad_sizes():
    with pytest.raises(ValueError, match="context_tokens"):
        size_report(LLAMA_8B, 0, GIB)
    with pytest.raises(ValueError, match="page_tokens"):
        size_report(LLAMA_8B, 10, GIB, page_tokens=0)
    with pytest.raises(ValueError, match="vram_bytes"):
        size_report(LLAMA_8B, 10, -1)


@pytest.mark.parametrize(
    "text, num_bytes",
    [
        ("80GiB", 80 * GIB),
        ("80 gib", 80 * GIB),
        ("1.5GB", 1_500_000_000),
        ("512", 512),
        ("512B", 512),
        ("4KB", 4000),
        ("4KiB", 4096),
        ("0.5MiB", 2**19),
        ("2TiB", 2 * 2**40),
    ],
)
def test_parse_bytes(text, num_bytes):
    assert parse_bytes(text) == num_bytes


@pytest.mark.parametrize("text", ["", "GiB", "80XB", "-1GiB", "1.5B", "80 Gi B", "1e9", None])
def test_parse_bytes_rejects(text):
    with pytest.raises(ValueError, match="byte size"):
        parse_bytes(text)


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(16 * GIB) == "16.0 GiB"
    assert format_bytes(1536) == "1.5 KiB"


def test_resolve_spec():
    assert resolve_spec("llama-3.1-8b") == LLAMA_8B
    assert resolve_spec("LLAMA-3.1-8B", "fp16").dtype == "float16"
    custom = resolve_spec("llama-3.1-8b", None, 40)
    assert (custom.name, custom.num_layers, custom.num_kv_heads) == ("custom", 40, 8)
    named = resolve_spec("my-model", None, 4, 2, 64)
    assert named == ModelSpec("my-model", 4, 2, 64, "bfloat16")
    with pytest.raises(ValueError, match="unknown model 'my-model'"):
        resolve_spec("my-model", None, 4)
    with pytest.raises(ValueError, match="num_layers"):
        resolve_spec("llama-3.1-8b", None, 0)


def test_cli_json_output_parses(app):
    args = ("--model", "llama-3.1-70b", "--context", "131072", "--vram", "80GiB", "--json")
    result = run(app, *args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["bytes_per_token"] == 327680
    assert report["sequences_fit"] == 2
    assert report["model"]["name"] == "llama-3.1-70b"


def test_cli_custom_geometry_without_preset_is_named_custom(app):
    args = ("--layers", "2", "--kv-heads", "2", "--head-dim", "16", "--dtype", "fp32", "--json")
    result = run(app, "--context", "512", "--page-tokens", "16", *args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["model"]["name"] == "custom"
    assert report["bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    assert report["pages_per_sequence"] == 32


def test_cli_table(app):
    result = run(app, "--vram", "80GiB")
    assert result.exit_code == 0, result.output
    for text in ("llama-3.1-8b", "bfloat16", "fp8", "int8", "16.0 GiB", "128.0 KiB"):
        assert text in result.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "gpt-17"], "unknown model 'gpt-17'"),
        (["--vram", "lots"], "bad byte size 'lots'"),
        (["--context", "0"], "context_tokens"),
        (["--dtype", "fp4"], "unknown dtype 'fp4'"),
    ],
)
def test_cli_errors_exit_nonzero_with_message(app, args, message):
    result = run(app, *args)
    assert result.exit_code != 0
    assert message in result.output
