"""Side-by-side benchmarks: gradwire push_pull against torch.distributed gloo all_reduce."""
