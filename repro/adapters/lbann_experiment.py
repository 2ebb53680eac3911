"""Build a plan (plan.json, from repro.adapters.lbann.plan) with LBANN's Python front end and save it
as experiment.prototext: `python3 -I lbann_experiment.py PLAN PROTOTEXT`.

It runs under LBANN's own Python (its front end pins protobuf 3.x/4.21, which the kit's packages
outgrew), so it imports nothing but the standard library and `lbann`. `-I` keeps this file's folder,
which holds the adapter module also named lbann.py, off sys.path.
"""
import json
import sys

import lbann
import lbann.modules
import lbann.proto
from lbann import reader_pb2


def initializer(std):
    return lbann.NormalInitializer(mean=0.0, standard_deviation=std)


def zero_bias():
    return lbann.Weights(initializer=lbann.ConstantInitializer(value=0.0))


def apply_layer(x, layer):
    kind = layer["kind"]
    if kind == "convolution":
        conv = lbann.modules.Convolution2dModule(
            layer["out_channels"], layer["kernel_size"], stride=layer["stride"], padding=layer["padding"],
            bias=True, weights=[lbann.Weights(initializer=initializer(layer["init_std"])), zero_bias()],
        )
        return conv(x)
    if kind == "fully_connected":
        dense = lbann.modules.FullyConnectedModule(
            layer["size"], bias=True,
            weights=[lbann.Weights(initializer=initializer(layer["init_std"])), zero_bias()],
        )
        return dense(x)
    if kind == "relu":
        return lbann.Relu(x)
    if kind == "max_pool":
        return lbann.Pooling(x, num_dims=2, has_vectors=False, pool_dims_i=layer["size"],
                             pool_strides_i=layer["stride"], pool_mode="max")
    if kind == "dropout":
        return lbann.Dropout(x, keep_prob=layer["keep_prob"])
    raise ValueError(f"unknown layer kind {kind!r}")


def build_model(plan):
    images = lbann.Input(data_field="samples")
    labels = lbann.Input(data_field="labels")
    x = images
    for layer in plan["layers"]:
        x = apply_layer(x, layer)
    probs = lbann.Softmax(x)
    cross_entropy = lbann.CrossEntropy(probs, labels)
    accuracy = lbann.CategoricalAccuracy(probs, labels)
    objective = [cross_entropy]
    if plan["l2_scale"]:
        objective.append(lbann.L2WeightRegularization(scale=plan["l2_scale"]))
    callbacks = {"print": lbann.CallbackPrint, "timer": lbann.CallbackTimer,
                 "gpu_memory_usage": lbann.CallbackGPUMemoryUsage}
    clip = [lbann.CallbackClipGradientNorm(global_norm=True, value=plan["grad_clip"])] if plan["grad_clip"] else []
    return lbann.Model(
        plan["epochs"],
        layers=lbann.traverse_layer_graph([images, labels]),
        objective_function=lbann.ObjectiveFunction(objective),
        # The cross-entropy alone is logged too: the objective includes the L2 term.
        metrics=[lbann.Metric(accuracy, name="accuracy", unit="%"), lbann.Metric(cross_entropy, name="cross_entropy")],
        callbacks=[callbacks[name]() for name in plan["callbacks"]] + clip,
    )


def build_optimizer(spec):
    if spec["name"] == "sgd":
        return lbann.SGD(learn_rate=spec["learn_rate"], momentum=spec["momentum"])
    return lbann.Adam(learn_rate=spec["learn_rate"], beta1=spec["beta1"], beta2=spec["beta2"], eps=spec["eps"])


def build_reader(plan):
    message = reader_pb2.DataReader()
    for spec in plan["readers"]:
        reader = message.reader.add()
        for key in ("name", "role", "shuffle", "data_filedir", "data_filename", "num_labels"):
            setattr(reader, key, spec[key])
        reader.fraction_of_data_to_use = 1.0
        for transform in spec["transforms"]:
            [(kind, fields)] = transform.items()
            target = getattr(reader.transforms.add(), kind)
            target.SetInParent()
            for key, value in fields.items():
                setattr(target, key, value)
    return message


def main(plan_file, prototext):
    with open(plan_file) as f:
        plan = json.load(f)
    trainer = lbann.Trainer(mini_batch_size=plan["mini_batch_size"], random_seed=plan["seed"])
    lbann.proto.save_prototext(
        prototext, trainer=trainer, model=build_model(plan), data_reader=build_reader(plan),
        optimizer=build_optimizer(plan["optimizer"]),
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
