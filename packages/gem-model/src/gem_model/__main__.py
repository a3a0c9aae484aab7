"""``python -m gem_model [name ...]``: print the parameter summary of named configs (all by default)."""

import sys

from gem_model.config import CONFIG_NAMES, get_config
from gem_model.flops import model_summary


def main(argv: list[str]) -> None:
    for name in argv or CONFIG_NAMES:
        config = get_config(name)
        kinds = ", ".join(config.attention_kind(i) for i in range(config.n_layers))
        print(f"== {name}: d_model {config.d_model}, {config.n_layers} layers ({kinds}), "
              f"{config.n_heads}x{config.head_dim} heads, {config.n_experts} experts")  # fmt: skip
        print(model_summary(config))
        print()


if __name__ == "__main__":
    main(sys.argv[1:])
