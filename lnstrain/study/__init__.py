"""Scaling studies: sizes × norm schemes × seeds, planned, launched and summarised."""
