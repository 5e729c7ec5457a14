"""GPipe pipeline parts, one concept per module: partition, microbatch, schedule,
cell, executor, pipelining_layer, costs and trace."""
