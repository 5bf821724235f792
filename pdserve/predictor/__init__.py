"""Output-length prediction into buckets (TetriInfer): features, a softmax classifier, the manifest."""
