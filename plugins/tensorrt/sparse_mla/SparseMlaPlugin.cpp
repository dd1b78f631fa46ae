#include "SparseMlaPlugin.h"

#include "dhisparse/kernels.h"
#include "dhisparse/mla_row.h"

namespace dhisparse
{
namespace trt
{

using nvinfer1::DataType;

SparseMlaPlugin::SparseMlaPlugin(int32_t rank, int32_t rope, int32_t kv_format, float softmax_scale)
    : mRank(rank)
    , mRope(rope)
    , mKvFormat(kv_format)
    , mSoftmaxScale(softmax_scale)
{
    require(rank > 0 && rope >= 0, "kv_lora_rank must be > 0 and qk_rope_head_dim >= 0");
    require(kv_format >= kKvFloat32 && kv_format <= kKvFp8Ds32, "kv_format must be 0, 1 or 2");
    require(kv_row_bytes(kv_format, rank, rope) > 0, "kv_format 2 (FP8) needs rank 512, rope 64");
    require(softmax_scale > 0.0f, "softmax_scale must be > 0");
}

SparseMlaPlugin SparseMlaPlugin::create(nvinfer1::PluginFieldCollection const* fc)
{
    FieldReader const f(fc);
    return SparseMlaPlugin(f.get_int32("kv_lora_rank", 0), f.get_int32("qk_rope_head_dim", -1),
        f.get_int32("kv_format", kKvBFloat16), f.get_float32("softmax_scale", 0.0f));
}

void SparseMlaPlugin::describe_fields(FieldList& fields)
{
    fields.add("kv_lora_rank", static_cast<int32_t const*>(nullptr));
    fields.add("qk_rope_head_dim", static_cast<int32_t const*>(nullptr));
    fields.add("kv_format", static_cast<int32_t const*>(nullptr));
    fields.add("softmax_scale", static_cast<float const*>(nullptr));
}

void SparseMlaPlugin::list_fields(FieldList& fields) const
{
    fields.add("kv_lora_rank", &mRank);
    fields.add("qk_rope_head_dim", &mRope);
    fields.add("kv_format", &mKvFormat);
    fields.add("softmax_scale", &mSoftmaxScale);
}

DataType SparseMlaPlugin::kvType() const
{
    return mKvFormat == kKvFloat32 ? DataType::kFLOAT : (mKvFormat == kKvBFloat16 ? DataType::kBF16 : DataType::kUINT8);
}

int32_t SparseMlaPlugin::getNbOutputs() const noexcept
{
    return kNbOutputs;
}

int32_t SparseMlaPlugin::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes, int32_t nbInputs) const noexcept
{
    if (nbOutputs != kNbOutputs || nbInputs != kNbInputs)
    {
        return -1;
    }
    outputTypes[0] = inputTypes[0];
    return 0;
}

int32_t SparseMlaPlugin::getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
    nvinfer1::DimsExprs const* /*shapeInputs*/, int32_t /*nbShapeInputs*/, nvinfer1::DimsExprs* outputs,
    int32_t nbOutputs, nvinfer1::IExprBuilder& /*exprBuilder*/) noexcept
{
    if (nbInputs != kNbInputs || nbOutputs != kNbOutputs || inputs[0].nbDims != 4)
    {
        return -1;
    }
    outputs[0] = inputs[0];
    return 0;
}

bool SparseMlaPlugin::supportsFormatCombination(
    int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    if (nbInputs != kNbInputs || nbOutputs != kNbOutputs)
    {
        return false;
    }
    switch (pos)
    {
    case 0: return is_linear(inOut, 0, DataType::kFLOAT) || is_linear(inOut, 0, DataType::kBF16);
    case 1:
    case 4: return is_linear(inOut, pos, inOut[0].desc.type);
    case 2: return is_linear(inOut, 2, kvType());
    case 3: return is_linear(inOut, 3, DataType::kINT32);
    default: return false;
    }
}

int32_t SparseMlaPlugin::configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
    nvinfer1::DynamicPluginTensorDesc const* /*out*/, int32_t nbOutputs) noexcept
{
    if (nbInputs != kNbInputs || nbOutputs != kNbOutputs || in[0].desc.dims.nbDims != 4
        || in[1].desc.dims.nbDims != 4 || in[2].desc.dims.nbDims != 2 || in[3].desc.dims.nbDims != 3)
    {
        return -1;
    }
    int64_t const width = mKvFormat == kKvFp8Ds32 ? kFp8RowBytes : mRank + mRope;
    auto const matches = [](int64_t dim, int64_t expected) { return dim == -1 || dim == expected; };
    return matches(in[0].desc.dims.d[3], mRank) && matches(in[1].desc.dims.d[3], mRope)
            && matches(in[2].desc.dims.d[1], width)
        ? 0
        : -1;
}

int32_t SparseMlaPlugin::enqueue(nvinfer1::PluginTensorDesc const* inputDesc,
    nvinfer1::PluginTensorDesc const* /*outputDesc*/, void const* const* inputs, void* const* outputs,
    void* /*workspace*/, cudaStream_t stream) noexcept
{
    nvinfer1::Dims const& q = inputDesc[0].dims;
    cuda::SparseMlaArgs const args{q.d[0], q.d[1], q.d[2], inputDesc[3].dims.d[2], mRank, mRope, mKvFormat,
        inputDesc[0].type == DataType::kBF16 ? 1 : 0, 4, mSoftmaxScale, inputs[0], inputs[1], inputs[2], inputs[3],
        outputs[0]};
    return cuda::launch_sparse_mla(args, stream) == cudaSuccess ? 0 : -1;
}

} // namespace trt
} // namespace dhisparse
