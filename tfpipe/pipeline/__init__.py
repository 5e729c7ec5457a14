"""GPipe pipeline parts that run a step, one concept per module: partition,
microbatch, schedule, cell, cell_functions, accumulate, portals, ties, replicas,
executor, pipelining_layer, costs (for automatic balance) and recorder (the
timestamps a measured step carries). Measuring and planning live in
`tfpipe.tuning`."""
