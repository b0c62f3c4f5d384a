"""kvtier.index"""
