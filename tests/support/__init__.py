"""Helpers shared by the test files (``from tests.support.<module> import ...``); nothing here is collected.

* ``compare``: run a loss with a random upstream gradient, compare two runs, relative L2, Inductor's caches off;
* ``graphs``: capture Dynamo's graph before and after the pass (``PassCapture``);
* ``patterns``: the graph-match test case of ``tests/fx_passes`` (``PatternTestCase``) and its inputs;
* ``inputs``: the inputs of the op, the kernels, the balanced path and the CUDA suite (one ``make_*_inputs`` each);
* ``reference``: the op against eager PyTorch in fp64 (``check_against_eager``) and its tolerances;
* ``head``: a tiny head (V = 13, D = 7) for edge cases: model snippets with the constants baked in, their inputs;
* ``kernels``: the kernel tests' harness (devices, option sets, the fp64 reference and the case table);
* ``models``: TinyGPT (also as source text, for subprocesses); ``hf``: tiny Hugging Face causal LMs;
* ``processes``: fresh Python processes (environment, run, read their JSON);
* ``distributed``: the pair of gloo worker processes that runs the distributed tests' tasks.

Helpers used by one test file only stay in that file.
"""
