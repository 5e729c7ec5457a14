"""Measuring and planning pipelined steps, one concept per module: timeline (the
measured bubble), gantt (its picture), trace (where the ops went), profile and
calibration (per-layer costs fitted to measured steps), simulator (a schedule
played on costs) and planner (the configuration to run). It reads the running
side (`tfpipe.pipeline`); nothing there imports this package."""
