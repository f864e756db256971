# Patch each attention head from a clean run into a corrupted one; plot the effect.
import matplotlib.pyplot as plt
import torch
from torch import nn

D, HEADS, LAYERS, SEQ = 16, 4, 2, 6


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out, self.hook_z = nn.Linear(D, 3 * D), nn.Linear(D, D), nn.Identity()

    def forward(self, x):  # (SEQ, D)
        q, k, v = self.qkv(x).reshape(SEQ, 3 * HEADS, -1).chunk(3, dim=1)
        pattern = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / (D // HEADS) ** 0.5, -1)
        z = self.hook_z(torch.einsum("hqk,khd->qhd", pattern, v))  # per head
        return x + self.out(z.reshape(SEQ, D))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Attention() for _ in range(LAYERS)])
        self.unembed = nn.Linear(D, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.unembed(x[-1])[0]  # one logit: the metric


torch.manual_seed(0)
model = Model().requires_grad_(False)
clean = torch.randn(SEQ, D)
corrupted = torch.cat([-clean[:1], clean[1:]])

cache = {}
handles = [
    model.blocks[layer].hook_z.register_forward_hook(lambda m, a, z, i=layer: cache.update({i: z}))
    for layer in range(LAYERS)
]
clean_out = model(clean)
for handle in handles:
    handle.remove()


def patched(layer, head):
    def patch(module, args, z):
        z = z.clone()
        z[:, head] = cache[layer][:, head]
        return z

    handle = model.blocks[layer].hook_z.register_forward_hook(patch)
    out = model(corrupted)
    handle.remove()
    return out


effect = torch.tensor(
    [[patched(i, h) - model(corrupted) for h in range(HEADS)] for i in range(LAYERS)]
)
plt.imshow(effect, cmap="RdBu")
plt.xlabel("head"), plt.ylabel("layer"), plt.colorbar(label="logit change")
plt.savefig("head_patching.png")
print(effect)
