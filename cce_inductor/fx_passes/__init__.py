"""fx passes"""
