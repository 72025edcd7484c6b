"""Drop-in nn.Module layers built on the rlx ops."""
