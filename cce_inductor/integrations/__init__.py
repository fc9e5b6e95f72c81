"""Routes from training libraries to the fused op, for code paths that the graph pass cannot see.

* :mod:`cce_inductor.integrations.trl`: TRL's fused LM head (``add_fused_lm_head``) computed by the fused op.
* :mod:`cce_inductor.integrations.torchtitan`: a torchtitan loss (``CCELoss``) that applies the output head and the
  cross-entropy in one call, in torchtitan's own terms (``Trainer.Config.loss``).

Each module imports its library only when used; ``import cce_inductor`` imports neither.
"""
