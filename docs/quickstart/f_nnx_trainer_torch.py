# Train a PyTorch model with torch.optim: clamp the gradient of every Linear layer's
# output, and log each layer's gradient norm every step.
import numpy as np
import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 32)
        self.fc2 = nn.Linear(32, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


model = MLP()
rng = np.random.default_rng(0)  # the twin's weights and data (PyTorch's weight is (out, in))
with torch.no_grad():
    for layer in (model.fc1, model.fc2):
        layer.weight.copy_(torch.tensor(rng.uniform(-0.5, 0.5, layer.weight.T.shape).T))
        layer.bias.zero_()
x = rng.normal(size=(64, 4)).astype(np.float32)
y = torch.tensor(np.stack([x[:, 0] * x[:, 1], np.sin(x[:, 2])], axis=1))
x = torch.tensor(x, requires_grad=True)  # (so that the first layer's hook fires)
norms = {}


def clamp(name):
    def hook(module, grad_output):
        norms[name] = grad_output[0].norm().item()
        return (grad_output[0].clamp(-0.01, 0.01),)

    return hook


for name, module in model.named_modules():
    if isinstance(module, nn.Linear):
        module.register_full_backward_pre_hook(clamp(name))


def loss_fn(model, x, y):
    return ((model(x) - y) ** 2).mean()


optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


for i in range(20):
    optimizer.zero_grad()
    loss = loss_fn(model, x, y)
    loss.backward()
    optimizer.step()
    print(f"step {i:2d}  loss {loss.item():.6f}  grad norms {norms}")
