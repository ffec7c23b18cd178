"""A plain PyTorch image classifier in the shape of the classic MNIST example, on scikit-learn's digits.

The digits (1797 8x8 images) ship inside scikit-learn, so nothing is downloaded.
mnist_port.py is this script ported to stratagem; `diff -u mnist_original.py mnist_port.py` shows how.

    python examples/ports/mnist_original.py --epochs 3
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from sklearn.datasets import load_digits
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset

import stratagem as sg

strategy = sg.strategy_from_env()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, 1, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, 1, padding=1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


def digits_datasets(test_every=5):
    """Every `test_every`-th image for testing, the rest for training; pixels scaled to [0, 1]."""
    images, labels = load_digits(return_X_y=True)
    x = torch.tensor(images, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(labels, dtype=torch.int64)
    test = torch.arange(len(y)) % test_every == 0
    return TensorDataset(x[~test], y[~test]), TensorDataset(x[test], y[test])


def train(args, model, device, train_loader, optimizer, epoch):
    model.train()
    @strategy.step
    def train_step(data, target):
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        return loss

    for batch_idx, (data, target) in enumerate(train_loader):
        loss = train_step(data, target)
        if batch_idx % args.log_interval == 0:
            strategy.print(f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_loader.dataset)}]\tLoss: {loss.item():.6f}")
            if args.dry_run:
                break


def test(model, device, test_loader):
    model.eval()
    test_loss = 0
    correct = 0
    with torch.no_grad():
        for data, target in test_loader:
            output = strategy.step(model, returns="gather")(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            pred = output.argmax(dim=1, keepdim=True)
            correct += pred.eq(target.view_as(pred)).sum().item()
    test_loss /= len(test_loader.dataset)
    accuracy = 100.0 * correct / len(test_loader.dataset)
    strategy.print(f"Test set: Average loss: {test_loss:.4f}, Accuracy: {correct}/{len(test_loader.dataset)} ({accuracy:.1f}%)")


def main():
    parser = argparse.ArgumentParser(description="Digits classifier (MNIST-style example)")
    parser.add_argument("--batch-size", type=int, default=64, help="input batch size for training (default: 64)")
    parser.add_argument("--test-batch-size", type=int, default=100, help="input batch size for testing (default: 100)")
    parser.add_argument("--epochs", type=int, default=3, help="number of epochs to train (default: 3)")
    parser.add_argument("--lr", type=float, default=1.0, help="learning rate (default: 1.0)")
    parser.add_argument("--gamma", type=float, default=0.7, help="learning rate step gamma (default: 0.7)")
    parser.add_argument("--no-accel", action="store_true", help="disables the GPU")
    parser.add_argument("--dry-run", action="store_true", help="quickly check a single pass")
    parser.add_argument("--seed", type=int, default=1, help="random seed (default: 1)")
    parser.add_argument("--log-interval", type=int, default=10, help="batches to wait before logging training status")
    parser.add_argument("--save-model", action="store_true", help="save the trained model")
    args = parser.parse_args()

    use_accel = not args.no_accel and torch.cuda.is_available()
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if use_accel else "cpu")

    train_set, test_set = digits_datasets()
    shuffle = torch.Generator().manual_seed(args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, generator=shuffle, pin_memory=use_accel)
    test_loader = DataLoader(test_set, batch_size=args.test_batch_size, pin_memory=use_accel)

    model = Net().to(device)
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    model, optimizer = strategy.distribute(model, optimizer)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    for epoch in range(1, args.epochs + 1):
        train(args, model, device, train_loader, optimizer, epoch)
        test(model, device, test_loader)
        scheduler.step()

    if args.save_model and strategy.is_chief:
        torch.save(model.state_dict(), "digits_cnn.pt")


if __name__ == "__main__":
    main()
