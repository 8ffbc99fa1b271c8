import pytest
import torch

from dpsm_ray.cards import build_model, check_model, default_model, model_cards

# every card, a card that takes an argument with an example of it
EVERY_MODEL = [f"{card.name}:resnet18" if card.argument else card.name for card in model_cards()]

INPUT_SHAPES = {"mlp": (1, 8, 8), "cnn": (1, 8, 8), "resnet50": (3, 64, 64), "densenet121": (3, 64, 64)}  # others: 3x32x32


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", EVERY_MODEL)
def test_every_model_maps_a_batch_to_class_logits(name):
    shape = INPUT_SHAPES.get(name, (3, 32, 32))
    torch.manual_seed(0)
    model = build_model(name, 7, input_shape=shape).eval()
    with torch.no_grad():
        logits = model(torch.randn(2, *shape))
    assert logits.shape == (2, 7) and torch.isfinite(logits).all()


@pytest.mark.parametrize(
    ("name", "classes", "published"),
    [
        # He et al. 2016, table 6 (CIFAR-10): ResNet-20 0.27M, -32 0.46M, -56 0.85M, -110 1.7M
        ("resnet20", 10, 0.27e6),
        ("resnet32", 10, 0.46e6),
        ("resnet56", 10, 0.85e6),
        ("resnet110", 10, 1.7e6),
        ("resnet110", 100, 1.7e6),
        # Huang et al. 2017, table 2: DenseNet-BC (L = 100, k = 12) 0.8M
        ("densenet100", 10, 0.8e6),
        ("densenet100", 100, 0.8e6),
    ],
)
def test_cifar_models_have_the_published_parameter_counts(name, classes, published):
    assert abs(parameter_count(build_model(name, classes)) - published) <= 0.05 * published


def test_the_papers_cifar100_models_are_within_the_stated_ranges():
    assert 1.6e6 <= parameter_count(build_model("resnet110", 100)) <= 1.8e6
    assert 0.75e6 <= parameter_count(build_model("densenet100", 100)) <= 0.85e6


def test_cifar_resnet_depth_is_6n_plus_2():
    from dpsm_ray.models import CifarResNet

    convolutions = [m for m in CifarResNet(110, 10).modules() if isinstance(m, torch.nn.Conv2d) and m.kernel_size == (3, 3)]
    assert len(convolutions) + 1 == 110  # 3x3 convolutions plus the linear layer (projections excluded)
    with pytest.raises(ValueError, match="depth 6n \\+ 2 .* got 21"):
        CifarResNet(21, 10)


@pytest.mark.parametrize(("name", "head"), [("resnet50", "fc"), ("densenet121", "classifier")])
def test_imagenet_models_get_a_head_for_the_classes(name, head):
    assert getattr(build_model(name, 13, input_shape=(3, 224, 224)), head).out_features == 13


def imagenet_file(tmp_path, name, rename=lambda key: key):
    """A state dict of ``name`` with the ImageNet 1000-class head, saved as a torchvision .pth is."""
    torch.manual_seed(1)
    state = build_model(name, 1000, input_shape=(3, 224, 224)).state_dict()
    path = tmp_path / f"{name}-imagenet.pth"
    torch.save({rename(key): value for key, value in state.items()}, path)
    return path, state


def assert_backbone_loaded(model, state, head):
    loaded = model.state_dict()
    for key, value in loaded.items():
        if key.startswith(head + "."):
            assert value.shape != state[key].shape  # the 1000-class head is not used
        else:
            assert torch.equal(value, state[key]), key


def test_pretrained_resnet50_loads_everything_but_the_head(tmp_path):
    path, state = imagenet_file(tmp_path, "resnet50")
    torch.manual_seed(2)  # a different initialisation, so equality means loaded
    model = build_model("resnet50", 10, input_shape=(3, 224, 224), pretrained_path=path)
    assert_backbone_loaded(model, state, "fc")
    assert model.fc.out_features == 10


def test_pretrained_densenet121_accepts_torchvisions_old_key_names(tmp_path):
    # torchvision's published DenseNet file names "denselayer1.norm1.weight" "denselayer1.norm.1.weight"
    def old_name(key):
        for layer in ("norm", "relu", "conv"):
            for index in ("1", "2"):
                key = key.replace(f".{layer}{index}.", f".{layer}.{index}.")
        return key

    path, state = imagenet_file(tmp_path, "densenet121", old_name)
    assert any(".norm.1." in key for key in torch.load(path, weights_only=True))
    torch.manual_seed(2)
    assert_backbone_loaded(build_model("densenet121", 10, pretrained_path=path), state, "classifier")


def test_a_missing_pretrained_file_is_named(tmp_path):
    path = tmp_path / "nowhere" / "resnet50.pth"
    with pytest.raises(FileNotFoundError, match=f"pretrained weights not found at {path}"):
        build_model("resnet50", 10, pretrained_path=path)


def test_weights_of_another_architecture_are_refused(tmp_path):
    path = tmp_path / "resnet110.pth"
    torch.save(build_model("resnet110", 10).state_dict(), path)
    with pytest.raises(ValueError, match="do not fit resnet50: .* backbone tensors are missing or of another shape"):
        build_model("resnet50", 10, pretrained_path=path)


def test_a_lenet_backbone_from_a_runs_weights_gets_a_new_seeded_head(tmp_path):
    """--pretrained-path for lenet: a run's model.pt of another class count; every tensor but the
    head's is the file's, the head is the fresh one the seed gives; another model's file fails."""
    path = tmp_path / "model.pt"
    torch.manual_seed(0)
    state = build_model("lenet", 12, input_shape=(1, 32, 32)).state_dict()
    torch.save(state, path)
    torch.manual_seed(5)
    fresh = build_model("lenet", 6, input_shape=(1, 32, 32)).state_dict()
    torch.manual_seed(5)
    model = build_model("lenet", 6, input_shape=(1, 32, 32), pretrained_path=path).state_dict()
    for key, value in model.items():
        assert torch.equal(value, fresh[key] if key.startswith("net.9.") else state[key]), key
    assert not torch.equal(model["net.0.weight"], fresh["net.0.weight"])
    torch.save(build_model("cnn", 12, input_shape=(1, 32, 32)).state_dict(), tmp_path / "cnn.pt")
    with pytest.raises(ValueError, match="do not fit lenet: 4 of its 6 backbone tensors are missing or of another shape \\(first: net.3.weight\\)"):
        build_model("lenet", 6, input_shape=(1, 32, 32), pretrained_path=tmp_path / "cnn.pt")


def test_pretrained_weights_are_only_for_the_imagenet_models(tmp_path):
    with pytest.raises(ValueError, match="pretrained_path is for the models resnet50, densenet121, lenet; got model 'resnet110'"):
        build_model("resnet110", 10, pretrained_path=tmp_path / "x.pth")


def test_default_models_follow_the_paper():
    assert default_model("digits") == default_model("synthetic:classes=3") == "mlp"
    assert default_model("cifar100") == "resnet110"
    assert default_model("caltech101") == default_model("inaturalist") == "resnet50"
    with pytest.raises(ValueError, match="got 'imagenet'"):
        default_model("imagenet")


def test_unknown_models_are_named_with_the_choices():
    with pytest.raises(ValueError, match="model must be one of mlp, mlp_bn, cnn, resnet20, .*; got 'resnet18'"):
        check_model("resnet18")
    with pytest.raises(ValueError, match="needs image inputs"):
        build_model("resnet110", 10, input_shape=(16,))


def test_conftr_s_fashion_mnist_mlp():
    """2 x 64 units, each Linear -> BatchNorm (momentum 0.1: Haiku's decay 0.9) -> ReLU."""
    import torch

    model = build_model("mlp_bn", 10, input_shape=(1, 28, 28))
    linear = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm1d)]
    assert [(m.in_features, m.out_features) for m in linear] == [(784, 64), (64, 64), (64, 10)]
    assert [(m.num_features, m.momentum) for m in norms] == [(64, 0.1), (64, 0.1)]
    assert model(torch.zeros(4, 1, 28, 28)).shape == (4, 10)


def test_a_torchvision_architecture_gets_the_datasets_classes_and_a_wrong_name_is_named():
    model = build_model("torchvision:resnet18", 5, input_shape=(3, 32, 32))
    assert model.fc.out_features == 5
    with pytest.raises(ValueError, match=r"model torchvision:resnet19: not a torchvision classification architecture \(close: .*resnet18"):
        check_model("torchvision:resnet19")
    with pytest.raises(ValueError, match=r"model: torchvision:resnet18 takes RGB images \[3, H, W\] or greyscale \[1, H, W\]"):
        build_model("torchvision:resnet18", 5, input_shape=(2, 32, 32))
    with pytest.raises(ValueError, match=r"model must be one of .*torchvision:NAME, or PKG.MODULE:FACTORY .*; got 'torchvision'"):
        check_model("torchvision")


def test_a_factory_of_ones_own_builds_the_network_and_is_checked(tmp_path, monkeypatch):
    (tmp_path / "my_nets.py").write_text(
        "from torch import nn\n"
        "def tiny(num_classes):\n    return nn.Sequential(nn.Flatten(), nn.Linear(12, num_classes))\n"
        "def wrong(num_classes):\n    return nn.Linear(12, 3)\n"
        "NOT_CALLABLE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    model = build_model("my_nets:tiny", 4, input_shape=(12,))
    assert model(torch.zeros(3, 12)).shape == (3, 4)
    with pytest.raises(ValueError, match=r"model my_nets:wrong: must return logits \[n, 4\] for inputs \[n, 12\]; got \[2, 3\]"):
        build_model("my_nets:wrong", 4, input_shape=(12,))
    with pytest.raises(ValueError, match="model my_nets:NOT_CALLABLE: my_nets has no callable 'NOT_CALLABLE'"):
        check_model("my_nets:NOT_CALLABLE")
    with pytest.raises(ValueError, match="model absent_pkg.nets:make: cannot import absent_pkg.nets"):
        check_model("absent_pkg.nets:make")
