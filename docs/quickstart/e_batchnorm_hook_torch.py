# A forward hook that changes a module's output, in a model with BatchNorm and its state.
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 8)
        self.bn = nn.BatchNorm1d(8)  # its running statistics are buffers of the module
        self.out = nn.Linear(8, 2)

    def forward(self, x):  # a batch
        return self.out(torch.relu(self.bn(self.fc(x))))


model = Net()


def halve(module, args, output):
    return output * 0.5


model.bn.register_forward_hook(halve)
x = torch.randn(16, 3)
out = model(x)
print(out[:2], model.bn.running_mean)
