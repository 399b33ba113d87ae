"""Compute kernels: attention, and the GEMMs and GEMVs the models route to."""
