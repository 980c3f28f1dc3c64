"""Evaluation of learned representations: kNN (during and after training) and linear probe."""
