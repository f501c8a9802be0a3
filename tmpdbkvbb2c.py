import torch
print('first line', flush=True)
