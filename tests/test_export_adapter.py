"""``flywheel export-adapter`` on the tiny model: the PEFT adapter as stored, or the base with it merged in (the
same logits as base + adapter), each with a model card naming the base, the training metrics, the rewards and
the gate results. The version comes from a real DuckDB store, read directly (no gateway running)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from flywheel.capture.store import Store
from flywheel.gateway.cli import app
from flywheel.gateway.storeproc import versions

METRICS = {"reward/mean": 0.625, "loss": 0.0123, "steps": 4}
GATE = {"offline": {"win_rate": 0.75, "contexts": 16, "passed": True}}


@pytest.fixture
def adapter(tiny_model: Path, tmp_path: Path) -> Path:
    """A LoRA on the tiny model with non-zero B matrices, so it changes the logits."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model),
                           LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                      init_lora_weights=False))
    model.save_pretrained(tmp_path / "adapter")
    return tmp_path / "adapter"


@pytest.fixture
def database(tiny_model: Path, adapter: Path, tmp_path: Path) -> str:
    path = str(tmp_path / "flywheel.duckdb")
    store = Store(path)
    try:
        with store.session() as session:
            versions.reserve(session, "agent", path_of=lambda n: tmp_path / f"v{n}", base_model=str(tiny_model),
                             status="candidate", path=str(adapter))
            row = versions.get(session, "agent", 1)
            row.metrics = METRICS
            session.add(row)
            session.commit()
            versions.record_gate(session, "agent", 1, GATE)
    finally:
        store.close()
    return path


def export(database: str, out: Path, *extra: str) -> str:
    result = CliRunner().invoke(app, ["export-adapter", "--alias", "agent", "--version", "1", "--out", str(out),
                                      "--database", database, *extra])
    assert result.exit_code == 0, result.output
    return result.output


def check_card(out: Path, tiny_model: Path) -> None:
    card = (out / "README.md").read_text()
    assert card.startswith(f"---\nbase_model: {json.dumps(str(tiny_model))}\n")
    assert "| reward/mean | 0.625 |" in card and "| loss | 0.0123 |" in card  # training metrics
    assert "## Rewards" in card
    assert '"win_rate": 0.75' in card  # gate results
    assert json.loads((out / "flywheel_version.json").read_text())["gate"] == GATE


def test_the_adapter_is_exported_as_stored_with_a_model_card(database: str, adapter: Path, tiny_model: Path,
                                                             tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert "PEFT adapter" in export(database, out)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (out / name).read_bytes() == (adapter / name).read_bytes()
    check_card(out, tiny_model)
    assert "library_name: peft" in (out / "README.md").read_text()
    refused = CliRunner().invoke(app, ["export-adapter", "--alias", "agent", "--version", "2", "--out",
                                       str(tmp_path / "none"), "--database", database])
    assert refused.exit_code != 0 and "has no version 2" in refused.output


def test_the_merged_model_gives_the_logits_of_base_plus_adapter(database: str, adapter: Path, tiny_model: Path,
                                                                tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "merged"
    export(database, out, "--merged")
    check_card(out, tiny_model)
    assert not (out / "adapter_config.json").exists()
    tokens = AutoTokenizer.from_pretrained(out)("plan a trip to Oslo", return_tensors="pt")
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(out).eval()(**tokens).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
        plain = base(**tokens).logits
        with_adapter = PeftModel.from_pretrained(base, str(adapter)).eval()(**tokens).logits
    assert not torch.allclose(plain, with_adapter, atol=1e-3)  # the adapter matters
    torch.testing.assert_close(merged, with_adapter, atol=1e-5, rtol=1e-4)
