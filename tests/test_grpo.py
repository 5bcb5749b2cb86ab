"""GRPO rounds on the tiny model through TRL's real GRPOTrainer, on captured groups.

One module-scoped round (4 steps, fresh LoRA) feeds most tests; a second, one-step round
continues from its adapter and optimizer state with a KL term and partly missing behaviour
logprobs. The settings follow docs/engineering-notes.md (initializer_range 0.1 in the tiny model, LoRA r 16
on every linear layer, lr 1e-2).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from flywheel.capture.batches import BranchTurn, GroupMember, TrainingGroup
from flywheel.trainer import adapters
from flywheel.trainer.grpo import train_round
from flywheel.trainer.grpo_args import GRPOArgs, RoundResult
from flywheel.trainer.sample_plan import CapturedRollout, plan_groups
from flywheel.trainer.samples import Sample, SampleBatch
from tests.conftest import WEATHER_TOOL, weather_followup
from tests.test_samples import CALL_TEXT, TOOL_CALL_MESSAGE, group_of, prompt_ids, single_turn

QUESTIONS = ["What is the weather?", "Tell me the weather."]
ANSWERS = ["Paris is sunny.", "It rains in London.", "Tokyo is cloudy.", "Berlin has wind."]
REWARDS = [1.0, 0.0, 0.0, 0.0]  # the first answer is the rewarded one, the second the punished one we watch


@dataclass
class Trained:
    tiny: Path
    tokenizer: Any
    result: RoundResult
    before: dict[str, float]  # answer -> total logprob under the base model (first question)
    groups: list[TrainingGroup]  # what it trained on, sampled by the base model


def logprobs(model: Any, prompt: list[int], completion: list[int]) -> list[float]:
    """Per-token log-probabilities of ``completion`` after ``prompt`` at temperature 1 (what the engine reports)."""
    import torch

    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return [float(x) for x in logits.log_softmax(-1).gather(1, torch.tensor(completion)[:, None]).squeeze(1)]


def load(tiny: Path, adapter: Path | None = None) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    return model.eval()


def exact_turn(tokenizer: Any, model: Any, messages: list[dict[str, Any]], text: str,
               response: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None) -> BranchTurn:
    """A turn as the gateway captures it from the engine: exact ids and the behaviour logprobs."""
    prompt = prompt_ids(tokenizer, messages, tools)
    completion = [*tokenizer(text, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    return BranchTurn(request_messages=messages, response_message=response or {"role": "assistant", "content": text},
                      tools=tools, prompt_token_ids=prompt, completion_token_ids=completion,
                      completion_logprobs=logprobs(model, prompt, completion), finish_reason="stop")


def answer_group(tokenizer: Any, model: Any, question: str, group_id: str) -> TrainingGroup:
    messages = [{"role": "user", "content": question}]
    return TrainingGroup(group_id=group_id, source="explicit", alias="agent", members=[
        GroupMember(trajectory_id=f"{group_id}-{i}", turns=[exact_turn(tokenizer, model, messages, a)], reward=r)
        for i, (a, r) in enumerate(zip(ANSWERS, REWARDS, strict=True))])


def tool_group(tokenizer: Any, model: Any) -> TrainingGroup:
    """Four two-turn tool-using trajectories (call get_weather, then answer), rewarded by their answer."""
    members = []
    for i, (answer, reward) in enumerate(zip(["It is sunny in Paris.", "Sunny.", "I do not know.", "Rain."],
                                             [1.0, 0.5, 0.0, 0.0], strict=True)):
        first = exact_turn(tokenizer, model, weather_followup("call_0")[:1], CALL_TEXT, TOOL_CALL_MESSAGE,
                           [WEATHER_TOOL])
        second = exact_turn(tokenizer, model, weather_followup("call_0"), answer, tools=[WEATHER_TOOL])
        members.append(GroupMember(trajectory_id=f"tool-{i}", turns=[first, second], reward=reward))
    return TrainingGroup(group_id="tool", source="task", alias="agent", members=members)


def answer_logprobs(tokenizer: Any, model: Any) -> dict[str, float]:
    prompt = prompt_ids(tokenizer, [{"role": "user", "content": QUESTIONS[0]}])
    return {a: sum(logprobs(model, prompt, [*tokenizer(a, add_special_tokens=False)["input_ids"],
                                            tokenizer.eos_token_id])) for a in ANSWERS}


@pytest.fixture(scope="module")
def trained(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Trained:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    base = load(tiny_model)
    groups = [answer_group(tokenizer, base, q, f"q{i}") for i, q in enumerate(QUESTIONS)]
    groups.append(tool_group(tokenizer, base))
    out_dir = adapters.alias_dir(tmp_path_factory.mktemp("data"), "agent") / "1"  # version 1, as the store says
    result = train_round(tiny_model, groups, GRPOArgs.tiny(max_steps=4, progress=False, proximal_policy="behaviour"),
                         out_dir=out_dir)
    return Trained(tiny_model, tokenizer, result, answer_logprobs(tokenizer, base), groups)


def lora_tensors(path: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(path / adapters.ADAPTER_WEIGHTS))


def test_a_round_changes_the_lora_weights_and_the_loss_is_finite(trained: Trained) -> None:
    result = trained.result
    assert result.status == "finished" and result.adapter_dir is not None
    tensors = lora_tensors(result.adapter_dir)
    lora_b = {k: v for k, v in tensors.items() if "lora_B" in k}
    assert len(lora_b) == 2 * 7  # 2 layers x (q, k, v, o, gate, up, down)
    # PEFT starts every lora_B at zero: after training they all moved.
    assert all(float(v.abs().max()) > 0 for v in lora_b.values())
    assert len(result.steps) == 4 and all(math.isfinite(s["loss"]) for s in result.steps)
    assert math.isfinite(result.metrics["losses/loss"]) and result.metrics["charts/steps"] == 4
    assert result.metrics["samples/groups_trained"] == 3 and result.metrics["samples/sequences"] == 12
    assert result.metrics["charts/tokens_per_s"] > 0
    assert result.metrics["charts/train_call_seconds"] >= result.metrics["charts/train_seconds"] > 0  # setup too


def test_trl_advantages_from_the_passthrough_rewards_equal_the_reference(trained: Trained) -> None:
    # Recorded inside the trainer: TRL's own advantages (from the captured rewards the pass-through
    # reward function handed it) minus ours, over every whole group, every generation batch.
    assert trained.result.metrics["advantage/trl_max_abs_diff"] < 1e-6
    assert all(s["advantage/trl_max_abs_diff"] < 1e-6 for s in trained.result.steps)


def test_proximal_behaviour_takes_the_ratio_against_the_captured_logprobs(trained: Trained) -> None:
    steps = trained.result.steps
    assert all(s["behaviour/captured_logprob_frac"] == 1.0 for s in steps)
    # Step 1: the captured logprobs are the base model's own, so every ratio is 1 and nothing clips.
    assert steps[0]["clip_ratio/region_mean"] == 0.0
    # Later steps train on samples the (now different) policy did not draw: against the captured
    # logprobs their ratios leave [0.8, 1.2] and clip. TRL's default (old = current policy) never would.
    assert max(s["clip_ratio/region_mean"] for s in steps[1:]) > 0.0
    # approx_kl (k3 of the same logratio): ~0 at step 1 (TRL's fused forward vs ours: float noise), then it grows.
    assert steps[0]["approx_kl"] < 1e-6
    assert min(s["approx_kl"] for s in steps[1:]) > 1e-4
    metrics = trained.result.metrics
    assert metrics["losses/approx_kl"] == pytest.approx(sum(s["approx_kl"] for s in steps) / len(steps))
    assert metrics["losses/clipfrac"] == pytest.approx(sum(s["clip_ratio/region_mean"] for s in steps) / len(steps))


def test_decoupled_the_ratio_is_taken_against_the_round_start_and_the_sampler_weighs_in(trained: Trained,
                                                                                        tmp_path: Path) -> None:
    # The same samples (drawn by the base model), trained further from the adapter above: an older sampler than
    # the policy, as when the training line runs ahead of the serving version.
    assert trained.result.adapter_dir is not None
    args = GRPOArgs.tiny(max_steps=6, progress=False, proximal_policy="round")
    result = train_round(trained.tiny, trained.groups, args,
                         init_adapter=trained.result.adapter_dir, out_dir=tmp_path / "2")
    steps = result.steps  # two epochs of three steps, a group each; an epoch is one generation batch
    generated = [s for s in steps if "behaviour/kl" in s]
    assert len(steps) == 6 and len(generated) == 2
    assert all(s["behaviour/captured_logprob_frac"] == 1.0 for s in generated)
    # The round's first step: the ratio is pi_theta / pi_prox = 1, however far the sampler is.
    assert steps[0]["approx_kl"] < 1e-6 and steps[0]["clip_ratio/region_mean"] == 0.0
    assert min(s["behaviour/kl"] for s in generated) > 1e-4  # the adapter is not the base model that sampled
    # Every later step, the second epoch's included: the policy moved from where the round began.
    assert min(s["approx_kl"] for s in steps[1:]) > 1e-6
    assert result.metrics["behaviour/kl"] == pytest.approx(sum(s["behaviour/kl"] for s in generated) / 2)


def test_decoupled_pi_prox_is_the_round_start_for_samples_first_trained_in_later_steps(trained: Trained,
                                                                                      tmp_path: Path) -> None:
    # One epoch of three optimizer steps, a group each, from a fresh LoRA: the round starts at the base model, which
    # drew every sample. pi_prox must be that start for all of them, not the policy a later step first meets them with.
    args = GRPOArgs.tiny(progress=False, proximal_policy="round", gradient_accumulation_steps=1)
    result = train_round(trained.tiny, trained.groups, args, out_dir=tmp_path / "1")
    steps = result.steps
    assert len(steps) == 3 and steps[0]["behaviour/captured_logprob_frac"] == 1.0
    assert steps[0]["behaviour/kl"] < 1e-6  # KL(mu || pi_prox), all the epoch's samples: mu is the start
    # The ratio pi_theta / pi_prox: 1 at the first step, then away from 1 as the round moves from its start; with
    # pi_prox taken at each sample's first step it would stay 1 and the clip would never bound the round.
    assert steps[0]["approx_kl"] < 1e-6
    assert min(s["approx_kl"] for s in steps[1:]) > 1e-6


def test_the_rewarded_answer_gains_logprob_over_the_punished_one(trained: Trained) -> None:
    assert trained.result.adapter_dir is not None
    after = answer_logprobs(trained.tokenizer, load(trained.tiny, trained.result.adapter_dir))
    rewarded, punished = ANSWERS[0], ANSWERS[1]
    margin_before = trained.before[rewarded] - trained.before[punished]
    margin_after = after[rewarded] - after[punished]
    print(f"\nlogprob {rewarded!r}: {trained.before[rewarded]:.2f} -> {after[rewarded]:.2f}; "
          f"{punished!r}: {trained.before[punished]:.2f} -> {after[punished]:.2f}; "
          f"margin {margin_before:.2f} -> {margin_after:.2f}")
    assert margin_after > margin_before + 5.0  # measured: see docs/trainer.md


def test_the_adapter_directory_is_complete_self_describing_and_vllm_loadable(trained: Trained) -> None:
    out = trained.result.adapter_dir
    assert out is not None and out.name == "1"
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [adapters.ADAPTER_CONFIG, adapters.ADAPTER_WEIGHTS, adapters.ROUND_FILE, adapters.OPTIMIZER_FILE])
    adapters.check_vllm_compatible(out)
    config = json.loads((out / adapters.ADAPTER_CONFIG).read_text())
    assert sorted(config["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                                                "v_proj"]
    record = adapters.read_round_file(out)
    assert record["version"] == 1 and record["alias"] == "agent"
    assert record["config"]["args"]["learning_rate"] == 1e-2 and record["config"]["trl"]["num_generations"] == 4
    assert record["config"]["trl"]["activation_checkpointing"] is False  # TRL's GRPOConfig would turn it on
    assert record["data"]["counts"] == {"groups_in": 3, "members_in": 12, "groups_trained": 3,
                                        "sequences_trained": 12}
    assert {g["group_id"] for g in record["data"]["groups"]} == {"q0", "q1", "tool"}
    assert adapters.is_complete(out) and not any(p.name.startswith(".") for p in out.parent.iterdir())


def test_the_adapter_files_are_the_ones_peft_writes(trained: Trained, tmp_path: Path) -> None:
    """adapters.write_lora skips PEFT's model card only: the same bytes as save_pretrained, for the adapter a round
    wrote (loaded back, trainable) and for fresh LoRAs."""
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model

    out = trained.result.adapter_dir
    assert out is not None

    def loaded() -> Any:
        return PeftModel.from_pretrained(load(trained.tiny), str(out), is_trainable=True)

    def fresh() -> Any:
        torch.manual_seed(0)
        return get_peft_model(load(trained.tiny), LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM"))

    def untyped() -> Any:  # no task type: PEFT writes an auto_mapping into its config
        torch.manual_seed(0)
        return get_peft_model(load(trained.tiny), LoraConfig(r=4, target_modules=["q_proj"]))

    for n, policy_of in enumerate((loaded, fresh, untyped)):  # a policy each: a save may fill in its config
        ours, peft = tmp_path / f"ours{n}", tmp_path / f"peft{n}"
        ours.mkdir()
        policy = policy_of()
        adapters.write_lora(policy, ours)
        policy_of().save_pretrained(str(peft), selected_adapters=["default"])
        assert sorted(p.name for p in ours.iterdir()) == [adapters.ADAPTER_CONFIG, adapters.ADAPTER_WEIGHTS]
        assert all((ours / name).read_bytes() == (peft / name).read_bytes()
                   for name in (adapters.ADAPTER_CONFIG, adapters.ADAPTER_WEIGHTS))
        assert not policy.peft_config["default"].inference_mode  # still training
    # what the round wrote, too; PEFT keeps target_modules in a set, whose order is the writing process's hash seed
    assert (out / adapters.ADAPTER_WEIGHTS).read_bytes() == (tmp_path / "ours0" / adapters.ADAPTER_WEIGHTS).read_bytes()
    round_config, config = (json.loads((d / adapters.ADAPTER_CONFIG).read_text()) for d in (out, tmp_path / "ours0"))
    assert set(round_config.pop("target_modules")) == set(config.pop("target_modules"))
    assert round_config == config


async def test_the_adapter_loads_into_the_local_engine(trained: Trained, tmp_path: Path) -> None:
    local = pytest.importorskip("flywheel.gateway.serving.engines.local")
    from flywheel.gateway.core.config import LocalEngineConfig

    assert trained.result.adapter_dir is not None
    engine = local.LocalEngine(LocalEngineConfig(model=str(trained.tiny)), tmp_path)
    await engine.start()
    try:
        await engine.load_adapter("agent@1", str(trained.result.adapter_dir))
        assert (await engine.health())["adapters"] == ["agent@1"]
        response = await engine.chat({"model": "agent@1", "messages": [{"role": "user", "content": QUESTIONS[0]}],
                                      "temperature": 0, "max_tokens": 8})
        assert response["choices"][0]["message"]["role"] == "assistant"
    finally:
        await engine.aclose()


def test_a_second_round_continues_from_the_adapter_and_its_optimizer_state(trained: Trained, tmp_path: Path) -> None:
    first = trained.result.adapter_dir
    assert first is not None
    base = load(trained.tiny)
    group = answer_group(trained.tokenizer, base, QUESTIONS[1], "again")
    sampled = [len(m.turns[0].completion_token_ids or []) for m in group.members]
    group.members[1].turns[0].params = {"temperature": 0.5}  # not the trainer's: its logprobs are of another softmax
    for member in group.members[2:]:  # two members without engine ids: rendered, no behaviour logprobs
        turn = member.turns[0]
        turn.prompt_token_ids = turn.completion_token_ids = turn.completion_logprobs = None
    args = GRPOArgs.tiny(max_steps=1, beta=0.04, progress=False)
    result = train_round(trained.tiny, [group], args, init_adapter=first, out_dir=tmp_path / "2",
                         optimizer_state=adapters.optimizer_state_of(first))
    assert result.adapter_dir is not None and result.metrics["charts/optimizer_resumed"] == 1.0
    assert result.config["derived"]["optimizer_state"] == "resumed"
    # only the first member's tokens are clipped against captured logprobs; the others against the policy's own
    assert result.metrics["behaviour/captured_logprob_frac"] == pytest.approx(sampled[0] / sum(sampled))
    assert result.metrics["samples/offpolicy_params_sequences"] == 1
    assert result.metrics["samples/retokenized"] == 2
    assert math.isfinite(result.metrics["losses/kl"]) and result.metrics["losses/kl"] >= 0
    assert math.isfinite(result.metrics["losses/loss"])
    before, after = lora_tensors(first), lora_tensors(result.adapter_dir)
    assert before.keys() == after.keys()  # only the trained adapter is saved, not TRL's frozen "ref" copy
    assert any(float((before[k] - after[k]).abs().max()) > 0 for k in before)


def test_nothing_trainable_skips_the_round_without_writing(tiny_model: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    same = group_of([(single_turn(tokenizer, "A."), 1.0), (single_turn(tokenizer, "B."), 1.0)])
    result = train_round(tiny_model, [same], GRPOArgs.tiny(progress=False), out_dir=tmp_path / "1")
    assert result.status == "skipped" and result.adapter_dir is None and not (tmp_path / "1").exists()
    assert result.skipped == {"zero_variance": {"groups": 1, "members": 2}}


def test_record_round_writes_the_training_run_and_adapter_version(trained: Trained, tmp_path: Path) -> None:
    from flywheel.capture.models import AdapterVersion, TrainingRun
    from flywheel.capture.store import Store

    store = Store(tmp_path / "store.duckdb")
    try:
        with store.session() as session:
            run, adapter = adapters.record_round(session, trained.result, alias="agent", base_model="tiny")
            failed = adapters.record_failure(session, alias="agent", error="out of memory")
        with store.session() as session:
            row = session.get(TrainingRun, run.id)
            assert row is not None and row.status == "finished" and row.group_ids == ["q0", "q1", "tool"]
            assert row.metrics is not None and row.metrics["losses/loss"] == trained.result.metrics["losses/loss"]
            assert adapter is not None and row.adapter_version_id == adapter.id
            version = session.get(AdapterVersion, adapter.id)
            assert version is not None and (version.version, version.status) == (1, "candidate")
            assert version.training_run_id == run.id
            failed_row = session.get(TrainingRun, failed.id)
            assert failed_row is not None and failed_row.status == "failed" and failed_row.error == "out of memory"
    finally:
        store.close()


# --------------------------------------------------------------------------- pure parts: no model


def test_only_the_loss_types_the_reference_covers_are_accepted() -> None:
    assert GRPOArgs(loss_type="sapo", importance_sampling_level="sequence").loss_type == "sapo"
    with pytest.raises(ValueError, match="loss_type must be one of grpo, dr_grpo, dapo, bnpo, cispo, sapo"):
        GRPOArgs(loss_type=cast(Any, "vespo"))
    with pytest.raises(ValueError, match="importance_sampling_level"):
        GRPOArgs(importance_sampling_level=cast(Any, "tokens"))


def fake_batch(sizes: dict[str, int], split: str | None = None) -> SampleBatch:
    samples = []
    for group_id, n in sizes.items():
        for i in range(n):
            member = i - 1 if group_id == split and i > 0 else i  # the split member has two sequences
            samples.append(Sample(group_id, f"{group_id}-{member}", member, int(group_id == split and i == 1),
                                  [1, 2], [3, i], [1, 1], None, float(i)))
    return SampleBatch(samples, list(sizes), [], "group", len(sizes), sum(sizes.values()))


def test_groups_are_bucketed_or_trimmed_to_one_size_never_padded() -> None:
    batch = fake_batch({"a": 4, "b": 4, "c": 3, "d": 5}, split="b")
    bucket = plan_groups(batch)
    assert bucket.group_size == 4 and bucket.slot_group_ids == ["a", "b"]
    assert bucket.native == [True, False]  # b has a split member: TRL's grouping cannot see its advantages
    assert {(s.group_id, s.reason) for s in bucket.skipped} == {("c", "group_size"), ("d", "group_size")}
    trim = plan_groups(batch, group_size=4, policy="trim", seed=1)
    assert trim.slot_group_ids == ["a", "b", "d"] and trim.native == [True, False, False]
    assert [(s.group_id, s.reason, s.members) for s in trim.skipped] == [("c", "group_size", 3), ("d", "trimmed", 1)]
    for slot in trim.slots:  # every slot: G distinct real samples of one group
        assert len(slot) == len(set(slot)) == 4 and len({batch.samples[i].group_id for i in slot}) == 1
    assert plan_groups(batch, group_size=4, policy="trim", seed=1).slots == trim.slots  # seeded


def test_the_rollout_serves_the_kth_sample_of_each_slot_on_every_process() -> None:
    batch = fake_batch({"a": 4, "b": 4})
    plan = plan_groups(batch)
    rollout = CapturedRollout(batch.samples, plan)
    # Process 1 of 2 holds global rows 4..7 of a generation batch of 8: the second slot, repeats 0..3.
    rollout.rows = [{"prompt": "b", "slot": 1}] * 4
    out = rollout([None] * 4, SimpleNamespace(accelerator=SimpleNamespace(process_index=1)))
    assert out["completion_ids"] == [[3, 0], [3, 1], [3, 2], [3, 3]] and out["logprobs"] is None
    assert out["captured_reward"] == [0.0, 1.0, 2.0, 3.0] and out["env_mask"] == [[1, 1]] * 4


def test_a_token_budget_trims_padding_and_the_reference_runs_once_per_sequence(trained: Trained,
                                                                               tmp_path: Path) -> None:
    from tests.test_grpo_micro_batches import reference_rows

    base = load(trained.tiny)
    groups = [answer_group(trained.tokenizer, base, QUESTIONS[0], "q0"), tool_group(trained.tokenizer, base)]
    results, counts = {}, {}
    for budget in (None, 64):  # 64 tokens: the two-turn tool sequences (~60) alone, the short answers together
        # rows counted one by one: a shared prompt prefix would pass the layers as one more row (test_shared_prefix.py)
        args = GRPOArgs.tiny(num_train_epochs=2, beta=0.04, max_tokens_per_micro_batch=budget, progress=False,
                             share_prompt_prefix=False)
        with reference_rows() as rows:  # a global hook: it sees the model the round builds
            results[budget] = train_round(trained.tiny, groups, args, out_dir=tmp_path / str(budget))
        counts[budget] = set(rows.values())
    whole, pieces = results[None].metrics, results[64].metrics
    # 2 epochs over 8 sequences: each passes the reference (every LoRA layer, adapter off) once, not once an epoch
    assert counts == {None: {8}, 64: {8}}
    assert whole["charts/steps"] == pieces["charts/steps"] == 4  # a group a step
    assert pieces["samples/forward_real_tokens"] == whole["samples/forward_real_tokens"]
    assert pieces["samples/padding_frac"] < whole["samples/padding_frac"] / 2
    # the first step trains the same parameters on the same sequences: the same loss, up to float32 round-off
    assert results[64].steps[0]["loss"] == pytest.approx(results[None].steps[0]["loss"], rel=1e-4, abs=1e-6)
    assert results[64].steps[0]["kl"] == pytest.approx(results[None].steps[0]["kl"], rel=1e-3, abs=1e-7)
    assert results[64].config["trl"]["gradient_accumulation_steps"] == 1
