"""The PyTorch twin of `small_cnn.SmallCNN`, made with a copy of its weights."""

import numpy as np
import torch

from small_cnn import SmallCNN


class TorchSmallCNN(torch.nn.Module):
    """`SmallCNN` in PyTorch: the same layers, names and weights, on a batch of images."""

    def __init__(self, cnn: SmallCNN):
        super().__init__()
        channels, _, kernel, _ = cnn.conv.weight.shape
        classes, features = cnn.fc.weight.shape
        self.conv = torch.nn.Conv2d(1, channels, kernel)
        self.act = torch.nn.ReLU()
        self.fc = torch.nn.Linear(features, classes)
        with torch.no_grad():  # an Equinox Conv2d bias is (out, 1, 1), PyTorch's (out,)
            for name in ("conv", "fc"):
                mine, theirs = getattr(self, name), getattr(cnn, name)
                mine.weight.copy_(torch.tensor(np.asarray(theirs.weight)))
                mine.bias.copy_(torch.tensor(np.asarray(theirs.bias).reshape(-1)))

    def forward(self, images: torch.Tensor) -> torch.Tensor:  # (batch, 1, size, size)
        return self.fc(self.act(self.conv(images)).flatten(1))
