"""A plain PyTorch DCGAN in the shape of pytorch/examples' dcgan: a generator and a discriminator, each with
BatchNorm and its own Adam, trained on small synthetic images (a bright square on a dark 8x8 field), so nothing
is downloaded. dcgan_port.py is this script ported to stratagem; `diff -u dcgan_original.py dcgan_port.py`
shows how.

    python examples/ports/dcgan_original.py --niter 2 --outf /tmp/dcgan
"""
import argparse
import os

import torch
import torch.nn as nn
import torch.optim as optim
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser(description="A small DCGAN on synthetic 8x8 images.")
parser.add_argument("--batchSize", type=int, default=16, help="input batch size")
parser.add_argument("--examples", type=int, default=100, help="size of the synthetic training set")
parser.add_argument("--nz", type=int, default=8, help="size of the latent z vector")
parser.add_argument("--ngf", type=int, default=8)
parser.add_argument("--ndf", type=int, default=8)
parser.add_argument("--niter", type=int, default=5, help="number of epochs to train for")
parser.add_argument("--lr", type=float, default=0.0002, help="learning rate")
parser.add_argument("--beta1", type=float, default=0.5, help="beta1 for adam")
parser.add_argument("--cuda", action="store_true", help="enables cuda")
parser.add_argument("--double", action="store_true", help="train in float64")
parser.add_argument("--outf", default="", help="folder to write the model checkpoints to")
parser.add_argument("--manualSeed", type=int, default=999, help="manual seed")
opt = parser.parse_args()

torch.manual_seed(opt.manualSeed)
device = torch.device("cuda:0" if opt.cuda else "cpu")
dtype = torch.float64 if opt.double else torch.float32
nc = 1


def synthetic_images(num, seed):
    """Images in [-1, 1]: a 3x3 square of random brightness at a random place on a dark field."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.full((num, nc, 8, 8), -1.0)
    for image in images:
        row, col = torch.randint(0, 6, (2,), generator=generator).tolist()
        image[:, row:row + 3, col:col + 3] = torch.rand(1, generator=generator) + 0.5
    return images.to(dtype)


dataset = TensorDataset(synthetic_images(opt.examples, seed=1), torch.zeros(opt.examples))
dataloader = DataLoader(dataset, batch_size=opt.batchSize, shuffle=True,
                        generator=torch.Generator().manual_seed(opt.manualSeed))


def weights_init(m):
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        torch.nn.init.normal_(m.weight, 0.0, 0.02)
    elif classname.find("BatchNorm") != -1:
        torch.nn.init.normal_(m.weight, 1.0, 0.02)
        torch.nn.init.zeros_(m.bias)


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(
            # z: nz x 1 x 1 -> (ngf*2) x 4 x 4
            nn.ConvTranspose2d(opt.nz, opt.ngf * 2, 4, 1, 0, bias=False),
            nn.BatchNorm2d(opt.ngf * 2),
            nn.ReLU(True),
            # -> nc x 8 x 8
            nn.ConvTranspose2d(opt.ngf * 2, nc, 4, 2, 1, bias=False),
            nn.Tanh(),
        )

    def forward(self, input):
        return self.main(input)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(
            # nc x 8 x 8 -> ndf x 4 x 4
            nn.Conv2d(nc, opt.ndf, 4, 2, 1, bias=False),
            nn.LeakyReLU(0.2, inplace=True),
            # -> (ndf*2) x 4 x 4
            nn.Conv2d(opt.ndf, opt.ndf * 2, 3, 1, 1, bias=False),
            nn.BatchNorm2d(opt.ndf * 2),
            nn.LeakyReLU(0.2, inplace=True),
            # -> 1 x 1 x 1
            nn.Conv2d(opt.ndf * 2, 1, 4, 1, 0, bias=False),
            nn.Sigmoid(),
        )

    def forward(self, input):
        return self.main(input).view(-1, 1).squeeze(1)


netG = Generator().to(device, dtype)
netG.apply(weights_init)
netD = Discriminator().to(device, dtype)
netD.apply(weights_init)

criterion = nn.BCELoss()
real_label = 1.0
fake_label = 0.0

optimizerD = optim.Adam(netD.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))
optimizerG = optim.Adam(netG.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))

for epoch in range(opt.niter):
    for i, (real_cpu, _) in enumerate(dataloader):
        real_cpu = real_cpu.to(device)
        noise = torch.randn(real_cpu.size(0), opt.nz, 1, 1, device=device, dtype=dtype)
        ############################
        # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
        ###########################
        # train with real
        netD.zero_grad()
        batch_size = real_cpu.size(0)
        label = torch.full((batch_size,), real_label, dtype=real_cpu.dtype, device=real_cpu.device)

        output = netD(real_cpu)
        errD_real = criterion(output, label)
        errD_real.backward()
        D_x = output.mean()

        # train with fake
        fake = netG(noise)
        label.fill_(fake_label)
        output = netD(fake.detach())
        errD_fake = criterion(output, label)
        errD_fake.backward()
        D_G_z1 = output.mean()
        errD = errD_real + errD_fake
        optimizerD.step()

        ############################
        # (2) Update G network: maximize log(D(G(z)))
        ###########################
        netG.zero_grad()
        label.fill_(real_label)  # fake labels are real for generator cost
        output = netD(fake)
        errG = criterion(output, label)
        errG.backward()
        D_G_z2 = output.mean()
        optimizerG.step()

        print(f"[{epoch}/{opt.niter}][{i}/{len(dataloader)}] Loss_D: {errD.item():.4f} Loss_G: {errG.item():.4f} "
              f"D(x): {D_x.item():.4f} D(G(z)): {D_G_z1.item():.4f} / {D_G_z2.item():.4f}")

    if opt.outf:
        os.makedirs(opt.outf, exist_ok=True)
        torch.save({"netG": netG.state_dict(), "netD": netD.state_dict()}, os.path.join(opt.outf, "dcgan.pth"))
