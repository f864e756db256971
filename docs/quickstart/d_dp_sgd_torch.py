# DP-SGD: clip every example's gradient to norm C, sum, add Gaussian noise, on a small CNN.
import torch
from opacus import PrivacyEngine
from torch import nn


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(1, 8, 3), nn.Linear(8 * 6 * 6, 2)

    def forward(self, x):  # a batch of (1, 8, 8) images
        return self.fc(torch.relu(self.conv(x)).flatten(1))


C, SIGMA, B = 1.0, 0.8, 64
x = torch.randn(512, 1, 8, 8)
y = (x.mean(dim=(1, 2, 3)) > 0).long()
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=B)
model = CNN()
optim = torch.optim.SGD(model.parameters(), lr=0.5)
model, optim, loader = PrivacyEngine().make_private(
    module=model, optimizer=optim, data_loader=loader, noise_multiplier=SIGMA, max_grad_norm=C
)

for epoch in range(3):
    for xb, yb in loader:
        optim.zero_grad()
        loss = nn.functional.cross_entropy(model(xb), yb)
        loss.backward()
        optim.step()
    with torch.no_grad():
        print(f"epoch {epoch}  accuracy {(model(x).argmax(1) == y).float().mean():.3f}")
