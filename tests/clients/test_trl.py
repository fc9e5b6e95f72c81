"""TRL: its trainers run untouched under the pass, and ``cce_inductor.integrations.trl`` computes TRL's fused LM head
with the op.

TRL 1.16's ``SFTTrainer`` patches the model with ``add_fused_lm_head`` and calls it without labels: the compiled
graphs hold no loss site, and a run with the pass on logs exactly what a run without it logs. With
``cce_inductor.integrations.trl.install()`` the fused head computes through the op: its per-token outputs equal
TRL's own ``ChunkedLogProbFunction`` (values and gradients), and an ``SFTTrainer`` run logs the same loss, entropy and
token accuracy as TRL's own head.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[clients]')")
trl = pytest.importorskip("trl", reason="trl is not installed (pip install -e '.[clients]')")
datasets = pytest.importorskip("datasets", reason="datasets is not installed (pip install -e '.[clients]')")

from trl.kernels import ChunkedLogProbFunction as TRLFunction  # noqa: E402

import cce_inductor  # noqa: E402
from cce_inductor.integrations import trl as cce_trl  # noqa: E402
from tests.clients._clients import assert_same_logs, sequences, tiny_model, tokenizer, training_logs  # noqa: E402


def _sft(tmp_path, name: str, steps: int = 3) -> list[dict]:
    args = trl.SFTConfig(
        output_dir=str(tmp_path / name),
        per_device_train_batch_size=4,
        max_steps=steps,
        logging_steps=1,
        learning_rate=1e-2,
        torch_compile=True,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    dataset = datasets.Dataset.from_list([{"input_ids": row} for row in sequences(12)])
    trainer = trl.SFTTrainer(model=tiny_model("llama"), args=args, train_dataset=dataset, processing_class=tokenizer())
    trainer.train()
    return training_logs(trainer.state.log_history)


@pytest.mark.slow
def test_sft_trainer_unharmed_by_the_pass(tmp_path, request):
    request.getfixturevalue("stock")
    want = _sft(tmp_path, "stock")
    request.getfixturevalue("cce_enabled")
    cce_inductor.reset_stats()
    got = _sft(tmp_path, "cce")
    stats = cce_inductor.stats()
    assert stats["graphs"] >= 1 and stats["rewritten"] == 0 and stats["skipped"] == 0, stats  # no loss site
    assert {"loss", "entropy", "mean_token_accuracy"} <= set(want[0]), want[0]
    assert max(entry.get("mean_token_accuracy", 0.0) for entry in want) > 0, want  # a metric that can differ
    assert_same_logs(got, want, rel=0.0, abs_=0.0)  # the same compiled code: bit for bit


@pytest.mark.slow
def test_sft_trainer_through_the_adapter(tmp_path, request):
    request.getfixturevalue("stock")
    want = _sft(tmp_path, "trl-head", steps=1)
    cce_inductor.reset_stats()
    cce_trl.install()
    try:
        torch._dynamo.reset()
        got = _sft(tmp_path, "cce-head", steps=1)
    finally:
        cce_trl.uninstall()
    assert cce_inductor.stats()["executions"]["linear_cross_entropy"] >= 1  # the op computed the step
    # One step: later steps compare two optimizer trajectories, which Adam separates from gradients that differ at
    # the 1e-4 level. This tiny model's gradient norm moves that much with the order of the head's sums alone: TRL's
    # own head gave 4.14124 eager and 4.14160 compiled (8.6e-5 apart), the op 4.14056 eager (1.7e-4 from TRL's
    # eager). Loss, entropy and token accuracy agree at fp32's level. (The op against TRL's function, values and
    # gradients at fp32's level: test_adapter_equals_trl_head.)
    assert_same_logs(got, want, rel=1e-5, abs_=1e-6, per_key={"grad_norm": 1e-3})


OUTPUTS = ("log_probs", "entropy", "is_top1")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "head",
    [dict(), dict(softcap=5.0), dict(temperature=0.7), dict(scale=0.5, bias=True)],
    ids=["plain", "softcap", "temperature", "scale-bias"],
)
def test_adapter_equals_trl_head(dtype, head):
    torch.manual_seed(0)
    n, d, v = 40, 16, 70
    hidden = (torch.randn(n, d) / 2).to(dtype).requires_grad_()
    weight = (torch.randn(v, d) / 2).to(dtype).requires_grad_()
    bias = torch.randn(v).to(dtype).requires_grad_() if head.get("bias") else None
    targets = torch.randint(0, v, (n,))
    args = (
        hidden,
        weight,
        bias,
        targets,
        head.get("temperature", 1.0),
        32,
        head.get("softcap"),
        head.get("scale", 1.0),
        OUTPUTS,
    )
    leaves = [x for x in (hidden, weight, bias) if x is not None]
    want = TRLFunction.apply(*args)
    got = cce_trl.log_probs(*args)
    assert got[2] is None and got[3] is None and want[2] is None and want[3] is None
    # TRL rounds each logit tile to the compute dtype before its fp32 epilogue; the op does not: bf16 differs by that
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=0.0, atol=0.1)
    torch.testing.assert_close(got[0], want[0], **tol)
    torch.testing.assert_close(got[1], want[1], **tol)
    assert got[4].dtype == torch.bool
    assert torch.equal(got[4], want[4])
    upstream = torch.rand(n), torch.rand(n)
    grads_want = torch.autograd.grad((want[0] * upstream[0]).sum() + (want[1] * upstream[1]).sum(), leaves)
    grads_got = torch.autograd.grad((got[0] * upstream[0]).sum() + (got[1] * upstream[1]).sum(), leaves)
    for g, w in zip(grads_got, grads_want):
        torch.testing.assert_close(
            g.float(),
            w.float(),
            rtol=1e-4 if dtype == torch.float32 else 0.05,
            atol=1e-5 if dtype == torch.float32 else 0.02,
        )


def test_adapter_falls_back_to_trl_for_other_outputs():
    torch.manual_seed(0)
    hidden, weight, targets = torch.randn(6, 8), torch.randn(11, 8), torch.randint(0, 11, (6,))
    outputs = ("log_probs", "mean_logits", "log_sum_sq_probs")
    want = TRLFunction.apply(hidden, weight, None, targets, 1.0, 32, None, 1.0, outputs)
    cce_inductor.reset_stats()
    got = cce_trl.log_probs(hidden, weight, None, targets, 1.0, 32, None, 1.0, outputs)
    assert cce_inductor.stats()["executions"]["linear_cross_entropy"] == 0  # TRL's function computed them
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if w is not None:
            torch.testing.assert_close(g, w)


def test_install_routes_add_fused_lm_head():
    import trl.trainer.utils as trl_utils

    original = trl_utils._ChunkedLogProbFunction
    model = tiny_model("llama")
    trl_utils.add_fused_lm_head(model, outputs=OUTPUTS)
    ids = torch.tensor([sequences(2)[0], sequences(2)[1]])
    want = model(input_ids=ids, labels=ids, fused_lm_head=True)
    cce_trl.install()
    cce_trl.install()  # idempotent
    try:
        assert trl_utils._ChunkedLogProbFunction is cce_trl.CCELogProbFunction
        cce_inductor.reset_stats()
        got = model(input_ids=ids, labels=ids, fused_lm_head=True)
        assert cce_inductor.stats()["executions"]["linear_cross_entropy"] == 1
    finally:
        cce_trl.uninstall()
    assert trl_utils._ChunkedLogProbFunction is original
    for name in ("loss", "log_probs", "entropy"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-5, atol=1e-5)
    assert torch.equal(got.is_top1, want.is_top1)
