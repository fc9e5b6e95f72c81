"""Tiny models shared by several test files.

TinyGPT is kept as source text (``MODEL_SRC``) so that subprocess scripts define exactly the same model.
"""

import textwrap

MODEL_SRC = textwrap.dedent(
    '''
    import torch
    import torch.nn as nn
    import torch.nn.functional as F


    class TinyGPT(nn.Module):
        """Embedding, one MLP block, lm_head without bias; the loss as in nanoGPT."""

        def __init__(self, vocab=97, dim=32, return_logits=False):
            super().__init__()
            self.wte = nn.Embedding(vocab, dim)
            self.fc = nn.Linear(dim, 4 * dim)
            self.proj = nn.Linear(4 * dim, dim)
            self.lm_head = nn.Linear(dim, vocab, bias=False)
            self.return_logits = return_logits

        def forward(self, idx, targets):
            x = self.wte(idx)
            x = x + self.proj(F.gelu(self.fc(x)))
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
            return (loss, logits) if self.return_logits else loss


    def make_batch(vocab=97, batch=2, seq=16, seed=0):
        gen = torch.Generator().manual_seed(seed)
        idx = torch.randint(0, vocab, (batch, seq), generator=gen)
        targets = torch.randint(0, vocab, (batch, seq), generator=gen)
        targets[0, :3] = -1  # some ignored positions
        return idx, targets
    '''
)

_namespace: dict = {}
exec(compile(MODEL_SRC, "<tiny_gpt>", "exec"), _namespace)
TinyGPT = _namespace["TinyGPT"]
make_batch = _namespace["make_batch"]
