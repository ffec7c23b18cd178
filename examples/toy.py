"""The toy problem every example trains: 4 classes from 20 features, learnable in a few epochs."""

import torch


def make_loader(batch_size: int = 128, examples: int = 1024) -> torch.utils.data.DataLoader:
    """A loader of GLOBAL batches; the strategy splits each one among its replicas."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(examples, 20, generator=generator)
    y = (x[:, :4].sum(dim=1) > 0).long() + 2 * (x[:, 4] > 0).long()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size,
                                       shuffle=True, generator=generator)


def make_net() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                               torch.nn.ReLU(), torch.nn.Linear(64, 4))
