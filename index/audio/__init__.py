"""Audio in: decoding and length fitting, the accepted upload formats, short-clip padding (rank 1).

May import: index.errors.
"""
