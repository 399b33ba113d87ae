"""The offloading connector's tiers: CPU memory and disk, with identity-checked block files."""
