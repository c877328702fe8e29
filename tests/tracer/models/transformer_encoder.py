"""``nn.TransformerEncoder`` (batch first, GELU, a final LayerNorm) between an embedding and a head,
called with a key padding mask: a torch.nn module that cannot be rebuilt from hyperparameters
(its ``__init__`` takes a layer) and whose layers do not trace symbolically."""

import torch
import torch.nn as nn


class Classifier(nn.Module):
    def __init__(
        self,
        vocab: int = 20,
        width: int = 16,
        heads: int = 2,
        layers: int = 3,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(
            width, heads, 2 * width, dropout, activation="gelu", batch_first=True
        )
        self.encoder = nn.TransformerEncoder(
            layer, layers, norm=nn.LayerNorm(width), enable_nested_tensor=False
        )
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids), src_key_padding_mask=pad))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Classifier()


def example_inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    ids = torch.randint(0, 20, (batch_size, 8), generator=torch.Generator().manual_seed(1))
    pad = torch.zeros(batch_size, 8, dtype=torch.bool)
    pad[-1, 6:] = True
    return ids, pad
