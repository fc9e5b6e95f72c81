"""The graph-match test case of ``tests/fx_passes`` and its inputs.

:class:`PatternTestCase` compiles a function with :class:`~tests.support.graphs.PassCapture` (the pass, then the
rewritten graph run eagerly), checks the number of rewrites and the parity of the loss and of every gradient with
eager PyTorch, and keeps the graphs before and after for ``assertExpectedInline``; ``assert_refused`` checks a site
left alone and the one reason it reports. Inputs come from the global RNG (each test case seeds it in ``setUp``).
"""

from __future__ import annotations

import torch
from expecttest import TestCase

import cce_inductor

from .graphs import PassCapture

V, D = 37, 16  # vocabulary and hidden size: deliberately not multiples of anything
B, T = 2, 5


def _leaves(values):
    return [v for v in values if isinstance(v, torch.Tensor) and v.requires_grad and v.is_leaf]


class PatternTestCase(TestCase):
    def run_pass(self, fn, *inputs, options=None, rewrites=1, params=(), atol=1e-5, rtol=1e-5):
        """Compile ``fn`` with the capturing backend; check the rewrite count and parity with eager.

        ``params`` are extra leaf tensors (module parameters, closed-over weights) whose grads are compared.
        Returns the PassCapture (graphs before/after).
        """
        capture = PassCapture(options)
        compiled = torch.compile(fn, backend=capture, fullgraph=True)
        leaves = _leaves(list(inputs)) + list(params)

        def loss_and_grads(f):
            for leaf in leaves:
                leaf.grad = None
            out = f(*inputs)
            loss = out[0] if isinstance(out, tuple) else out
            if leaves:
                loss.sum().backward()
            return out, [leaf.grad.clone() if leaf.grad is not None else None for leaf in leaves]

        expected, expected_grads = loss_and_grads(fn)
        actual, actual_grads = loss_and_grads(compiled)
        self.assertEqual(capture.rewrites, [rewrites])
        expected_loss = expected[0] if isinstance(expected, tuple) else expected
        actual_loss = actual[0] if isinstance(actual, tuple) else actual
        self.assertEqual(actual_loss.dtype, expected_loss.dtype)
        self.assertEqual(actual_loss.shape, expected_loss.shape)
        torch.testing.assert_close(actual_loss, expected_loss, atol=atol, rtol=rtol, equal_nan=True)
        for got, want in zip(actual_grads, expected_grads):
            if want is None:
                self.assertIsNone(got)
            else:
                torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
        self.compiled_output = actual
        return capture

    def assert_refused(self, fn, *inputs, reason: str):
        cap = self.run_pass(fn, *inputs, rewrites=0)
        self.assertEqual(cap.before, cap.after)
        reasons = cce_inductor.stats()["reasons"]
        self.assertEqual(len(reasons), 1, reasons)
        self.assertIn(reason, next(iter(reasons)))
        return next(iter(reasons))


def rand_weight(*shape, requires_grad=True):
    return torch.randn(*shape, requires_grad=requires_grad)


def rand_hidden(*shape):
    return torch.randn(*shape, requires_grad=True)


def rand_labels(*shape, ignore_index=-100, fraction_ignored=0.3):
    labels = torch.randint(0, V, shape)
    labels[torch.rand(shape) < fraction_ignored] = ignore_index
    return labels
