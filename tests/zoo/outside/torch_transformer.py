"""A seq2seq model on nn.Transformer (encoder and decoder, causal target mask, padding masks)."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Seq2Seq(nn.Module):
    def __init__(self, vocab=64, d=32):
        super().__init__()
        self.src_emb = nn.Embedding(vocab, d)
        self.tgt_emb = nn.Embedding(vocab, d)
        self.transformer = nn.Transformer(d, 4, 2, 2, 64, dropout=0.1, batch_first=True)
        self.out = nn.Linear(d, vocab)

    def forward(self, src, tgt, src_pad):
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.size(1))
        h = self.transformer(
            self.src_emb(src),
            self.tgt_emb(tgt),
            tgt_mask=causal,
            src_key_padding_mask=src_pad,
            memory_key_padding_mask=src_pad,
            tgt_is_causal=True,
        )
        return self.out(h)


def build_model():
    torch.manual_seed(0)
    return Seq2Seq()


def example_inputs(batch_size):
    g = torch.Generator().manual_seed(1)
    src = torch.randint(1, 64, (batch_size, 10), generator=g)
    tgt = torch.randint(1, 64, (batch_size, 7), generator=g)
    pad = torch.zeros(batch_size, 10, dtype=torch.bool)
    pad[-1, -3:] = True
    return src, tgt, pad
