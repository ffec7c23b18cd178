"""One worker of the several-models test, run under `stratagem launch --workers 2`: one strategy distributes a
GAN's generator and discriminator (an Adam each), a frozen teacher and a student, and trains the GAN step and the
distillation step on every global batch, with torch's and a hand-written EMA of the generator updated after each
GAN step. Once with one local replica per worker (gradients summed in buckets) and once with two (combined locally
first). The chief saves what every model ends with to MW_OUT."""

from __future__ import annotations

import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from several_models_cases import (  # noqa: E402
    averaged,
    build_distillation,
    build_gan,
    distillation_step,
    gan_batches,
    gan_step,
    lerp_ema_,
)
from workers.common import chief_saves_each_case  # noqa: E402


def train(strategy, case):
    plain_g, plain_d, plain_opt_g, plain_opt_d = build_gan()
    g, opt_g = strategy.distribute(plain_g, plain_opt_g)
    d, opt_d = strategy.distribute(plain_d, plain_opt_d)
    plain_teacher, plain_student, plain_opt = build_distillation()
    teacher = strategy.distribute(plain_teacher)
    student, opt = strategy.distribute(plain_student, plain_opt)
    ema, hand = averaged(g), copy.deepcopy(g)
    gan, distil = gan_step(g, d, opt_g, opt_d), distillation_step(teacher, student, opt)
    for real, noise in strategy.distribute_dataset(gan_batches()):
        strategy.run(gan, args=(real, noise))
        ema.update_parameters(g)
        lerp_ema_(hand, g)
        strategy.run(distil, args=(real, noise))
    return {
        "models": {
            name: [r.state_dict() for r in model.replicas]
            for name, model in (("g", g), ("d", d), ("teacher", teacher), ("student", student))
        },
        "ema": ema.state_dict(),
        "hand": hand.state_dict(),
        "module": type(g.module).__name__,
        "explain": str(strategy.explain()),
    }


if __name__ == "__main__":
    sys.exit(chief_saves_each_case({"1 local": 1, "2 local": 2}, train, timeout=90))
