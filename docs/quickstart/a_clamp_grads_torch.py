# Clamp the gradient of every Linear layer's output in a training loop; log each
# layer's gradient norm every step.
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))
x = torch.randn(64, 4, requires_grad=True)  # (so that the first layer's hook fires)
y = torch.stack([x[:, 0] * x[:, 1], torch.sin(x[:, 2])], dim=1).detach()
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


optim = torch.optim.Adam(model.parameters(), lr=1e-2)


for i in range(20):
    optim.zero_grad()
    loss = loss_fn(model, x, y)
    loss.backward()
    optim.step()
    print(f"step {i:2d}  loss {loss.item():.4f}  grad norms {norms}")
