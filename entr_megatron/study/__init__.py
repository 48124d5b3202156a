"""Scaling studies: grids of ordinary train runs, their report and a throughput planner."""
