"""Planning: the size of every selected layer — uniform per layer, or one global budget spread by
predicted output error (allocation, sensitivity) — and the speed model that keeps a layer dense."""
