"""Pieces of the mesh_scan main job: methods, tasks, runs, derived figures, outputs, plots."""
