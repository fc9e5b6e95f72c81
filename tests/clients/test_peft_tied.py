"""PEFT LoRA (frozen head, adapters on the attention; also with the Trainer's activation checkpointing, the usual
LoRA recipe) and tied embeddings (GPT-2, Gemma) under transformers' ``Trainer`` with ``torch_compile=True``, the
user's code unchanged: with the pass on (``cce_inductor.enable()``, what ``CCE_INDUCTOR=1`` does at ``import
torch``) the loss site is rewritten (``stats()``), and every logged loss and grad norm equals the stock
``torch.compile`` run's."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[clients]')")
pytest.importorskip("accelerate", reason="accelerate is not installed (pip install -e '.[clients]')")

import cce_inductor  # noqa: E402
from tests.clients._clients import LMDataset, assert_same_logs, sequences, tiny_model, training_logs  # noqa: E402


def _train(model, tmp_path, name: str, **training_args) -> list[dict]:
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / name),
        per_device_train_batch_size=4,
        max_steps=3,
        logging_steps=1,
        learning_rate=1e-2,
        torch_compile=True,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
        **training_args,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=LMDataset(sequences(12)))
    trainer.train()
    return training_logs(trainer.state.log_history)


def _lora(model):
    peft = pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[clients]')")
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, bias="none", task_type="CAUSAL_LM"
    )
    return peft.get_peft_model(model, config)


CASES = {
    # LoRA on the attention, the head frozen: the fused op computes no gradient for it
    "llama-lora": lambda: _lora(tiny_model("llama")),
    # tied embeddings: the head's weight is the embedding's
    "gpt2-tied": lambda: tiny_model("gpt2"),
    "gemma-tied": lambda: tiny_model("gemma"),
    # LoRA with the Trainer's activation checkpointing of the layers (two of them)
    "llama-lora-checkpointing": lambda: _lora(tiny_model("llama", num_hidden_layers=2)),
}
TRAINING_ARGS = {"llama-lora-checkpointing": {"activation_checkpointing": True}}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_rewritten_and_equal_to_stock(case, tmp_path, request):
    request.getfixturevalue("stock")
    want = _train(CASES[case](), tmp_path, "stock", **TRAINING_ARGS.get(case, {}))

    request.getfixturevalue("cce_enabled")
    cce_inductor.reset_stats()
    model = CASES[case]()
    if case.endswith("tied"):
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    if "lora" in case:
        assert not model.get_output_embeddings().weight.requires_grad
    got = _train(model, tmp_path, "cce", **TRAINING_ARGS.get(case, {}))
    if case.endswith("checkpointing"):
        assert model.base_model.model.is_activation_checkpointing  # the Trainer turned it on
    stats = cce_inductor.stats()
    assert stats["rewritten"] == 1 and not stats["reasons"], stats
    assert stats["executions"]["linear_cross_entropy"] == 3, stats
    assert_same_logs(got, want, rel=1e-5)
