"""Worker processes started and kept: local launch (forks of a warm template), Ray actors,
the restart policy, and the tensor-parallel ranks and cores of each role."""
