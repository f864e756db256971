# Capture every layer's activations.
import torch
from torch import nn

model = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))
x = torch.randn(64, 4)

cache = {}
for name, module in model.named_modules():
    if name:  # "" is the model itself
        module.register_forward_hook(lambda m, args, out, name=name: cache.update({name: out}))
out = model(x)
for name, activation in cache.items():
    print(name, tuple(activation.shape))  # 0 (64, 32), 1 (64, 32), 2 (64, 32), ...
