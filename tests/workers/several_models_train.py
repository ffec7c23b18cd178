"""One worker of the several-models tests, run under `stratagem launch` (2 or 3 workers): one strategy distributes a
GAN's generator and discriminator (an Adam each), a frozen teacher and a student, and trains the GAN step and the
distillation step on every global batch, with torch's and a hand-written EMA of the generator updated after each
GAN step; the same strategy then trains a GAN whose discriminator's pass is weighted by declared token counts (the
generator's gradient kept from the pass before) and a model whose expert some slices do not reach. Each case of
MW_CASES ("local replicas per worker" numbers, comma-separated; 1: gradients summed in buckets, 2: combined locally
first) is a new strategy, with gradient buckets of MW_BUCKET_MB. The chief saves what every model ends with to
MW_OUT."""

from __future__ import annotations

import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from several_models_cases import (  # noqa: E402
    averaged,
    build_distillation,
    build_gan,
    build_routed,
    distillation_step,
    gan_batches,
    gan_step,
    lerp_ema_,
    routed_batches,
    routed_step,
    token_gan_batches,
    token_gan_step,
)
from workers.common import chief_saves_each_case, setting  # noqa: E402

import stratagem as sg  # noqa: E402


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
    plain_g, plain_d, plain_opt_g, plain_opt_d = build_gan()
    token_g, token_opt_g = strategy.distribute(plain_g, plain_opt_g)
    token_d, token_opt_d = strategy.distribute(plain_d, plain_opt_d)
    token = token_gan_step(token_g, token_d, token_opt_g, token_opt_d, declare=sg.set_loss_weight)
    changes = [
        float(c)
        for batch in strategy.distribute_dataset(token_gan_batches())
        for c in strategy.experimental_local_results(strategy.run(token, args=batch))
    ]
    routed, routed_opt = strategy.distribute(*build_routed())
    routed_train = routed_step(routed, routed_opt)
    for batch in strategy.distribute_dataset(routed_batches()):
        strategy.run(routed_train, args=batch)
    return {
        "models": {
            name: [r.state_dict() for r in model.replicas]
            for name, model in (
                ("g", g),
                ("d", d),
                ("teacher", teacher),
                ("student", student),
                ("token g", token_g),
                ("token d", token_d),
                ("routed", routed),
            )
        },
        "kept gradient changes": changes,
        "ema": ema.state_dict(),
        "hand": hand.state_dict(),
        "module": type(g.module).__name__,
        "explain": str(strategy.explain()),
    }


if __name__ == "__main__":
    cases = {f"{local} local": int(local) for local in setting("MW_CASES").split(",")}
    options = {"bucket_mb": float(setting("MW_BUCKET_MB")), "first_bucket_mb": float(setting("MW_BUCKET_MB"))}
    sys.exit(chief_saves_each_case(cases, train, timeout=90, options=options))
