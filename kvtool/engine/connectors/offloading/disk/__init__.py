"""The disk tier: its files, index, layout, identity header and report."""
