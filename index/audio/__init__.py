"""Audio in: decoding and length fitting, the accepted upload formats, short-clip padding (rank 2).

May import: index.errors.
"""
