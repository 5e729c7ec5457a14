"""The base class of registered experiments (Lingvo's SingleTaskModelParams).

A subclass describes one experiment: its input for each split and its task.
`Model()` assembles them into the single Params tree that the trainer builds
from, overrides (`--params_override`, gin) edit, and every job dumps to
`params.txt`.
"""
from __future__ import annotations

from typing import Optional

from tfpipe.hyperparams import Params

SPLITS = ('train', 'dev', 'test')


class SingleTaskModelParams:
    """Override Train() and Task(); Dev() and Test() when the model is evaluated."""

    def Train(self) -> Params:
        raise NotImplementedError(f'{type(self).__name__} must define Train()')

    def Dev(self) -> Optional[Params]:
        return None

    def Test(self) -> Optional[Params]:
        return None

    def Task(self) -> Params:
        raise NotImplementedError(f'{type(self).__name__} must define Task()')

    def Model(self) -> Params:
        p = Params()
        p.Define('name', type(self).__name__, 'Experiment class name.')
        p.Define('task', self.Task(), 'The task: model, losses, train and eval settings.')
        inputs = Params()
        for split, method in zip(SPLITS, (self.Train, self.Dev, self.Test)):
            inputs.Define(split, method(), f'Input of the {split} split (None: not defined).')
        p.Define('input', inputs, 'Input params per split.')
        return p


class TfdsModelParams(SingleTaskModelParams):
    """An experiment whose splits all come from one tfds dataset.

    `TFDS_SPLITS` maps tfpipe's splits to the dataset's (a split left out is not
    defined); subclasses write `InputParams(tfds_split, training)` once instead
    of three near-identical Train/Dev/Test methods.
    """

    TFDS_SPLITS = {'train': 'train', 'dev': 'validation', 'test': 'test'}

    def InputParams(self, tfds_split: str, training: bool) -> Params:
        raise NotImplementedError(f'{type(self).__name__} must define InputParams()')

    def _Split(self, split: str, training: bool) -> Optional[Params]:
        tfds_split = self.TFDS_SPLITS.get(split)
        return None if tfds_split is None else self.InputParams(tfds_split, training)

    def Train(self) -> Params:
        return self._Split('train', True)

    def Dev(self) -> Optional[Params]:
        return self._Split('dev', False)

    def Test(self) -> Optional[Params]:
        return self._Split('test', False)
